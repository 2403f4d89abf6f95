"""One router per resource of the job API; `broker.api.main` assembles them."""
