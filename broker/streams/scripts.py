"""The Lua scripts of the streams, and the one place that runs them.

A script is what makes a step atomic (publish-if-owned: the outputs and the ack, or neither) or
bounded (every read sized on the server before anything is transferred). A Redis user without the
`@scripting` ACL category is refused them: `Scripts.run` then answers None and each caller does
the same with plain commands, sized after the transfer and not atomic.
"""

from __future__ import annotations

import logging
from typing import Any

from redis.exceptions import NoPermissionError

log = logging.getLogger(__name__)


# publish_if_owned: KEYS = (source stream, output stream); ARGV = group, consumer, field name, the
# output stream's wake-up channel, then per source entry: its id, the number of messages n, n
# encoded messages. Publishes one wake-up (Wakeups.wait) when it added anything.
PUBLISH_IF_OWNED = """
local out = {}
local added = false
local i = 5
while i <= #ARGV do
  local eid, n = ARGV[i], tonumber(ARGV[i + 1])
  local held = redis.call('XPENDING', KEYS[1], ARGV[1], eid, eid, 1, ARGV[2])
  if #held == 1 then
    for j = 1, n do
      redis.call('XADD', KEYS[2], '*', ARGV[3], ARGV[i + 1 + j])
      added = true
    end
    redis.call('XACK', KEYS[1], ARGV[1], eid)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
  i = i + 2 + n
end
-- pcall: a user without PUBLISH rights (no @pubsub in its ACL) still publishes; readers poll
if added then redis.pcall('PUBLISH', ARGV[4], '') end
return out
"""


# publish_many on a cluster (whose client refuses PUBLISH inside MULTI/EXEC): KEYS = (stream,);
# ARGV = field name, wake-up channel ('' for none), encoded messages. XADDs them all, then wakes.
PUBLISH_MANY = """
local ids = {}
for i = 3, #ARGV do ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[i]) end
if ARGV[2] ~= '' then redis.pcall('PUBLISH', ARGV[2], '') end
return ids
"""


# touch: KEYS = (stream,); ARGV = group, consumer, entry ids. Each entry still pending for the
# consumer is XCLAIMed by it again with JUSTID: its idle time starts over, its delivery count is
# kept. Returns 1 per entry held, 0 per entry acked or taken over (left alone).
TOUCH = """
local out = {}
for i = 3, #ARGV do
  local held = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #held == 1 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""

# READ: one script for every read, so a consumer never receives an entry it has not sized.
# KEYS = (stream,); ARGV = mode, group, consumer, count, max entry bytes, max read bytes, start,
# min idle ms (claim), field name, bytes kept of an oversized entry, max fields per entry.
# Modes: "new" (XREADGROUP >), "pending" (XREADGROUP from `start` in the consumer's own PEL),
# "claim" (XAUTOCLAIM from cursor `start`), "range"/"revrange" (XRANGE / XREVRANGE from `start`).
# Entries are taken one at a time until `count` or until the bytes returned reach max read bytes:
# the reply holds at most max read bytes + max entry bytes of payload. An entry over max entry
# bytes (or with too many fields) comes back as its id, its size and the first bytes of its
# payload only, and is still delivered (pending), so the caller can dead-letter and ack it.
# Returns {next start / cursor, {{id, status, payload or size, deliveries, prefix}, ...}}.
READ = """
local key, mode, group, consumer = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local count, max_entry, budget = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local start, min_idle, field = ARGV[7], ARGV[8], ARGV[9]
local keep, max_fields = tonumber(ARGV[10]), tonumber(ARGV[11])
local out, total = {}, 0

local function times_delivered(id)
  local p = redis.call('XPENDING', key, group, id, id, 1)
  if #p == 1 then return p[1][4] end
  return 1
end

local function take(id, fields, n)
  if #fields > 2 * max_fields then
    out[#out + 1] = {id, 'fields', #fields / 2, n, ''}
    return
  end
  local size = 0
  for i = 1, #fields do size = size + #fields[i] end
  if size > max_entry then
    local prefix = ''
    for i = 1, #fields - 1, 2 do
      if fields[i] == field then prefix = string.sub(fields[i + 1], 1, keep) end
    end
    out[#out + 1] = {id, 'big', size, n, prefix}
    return
  end
  out[#out + 1] = {id, 'ok', fields, n, ''}
  total = total + size
end

if mode == 'new' then
  while #out < count and total < budget do
    local r = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1, 'STREAMS', key, '>')
    if not r then break end
    local e = r[1][2][1]
    take(e[1], e[2], 1)
  end
  return {'', out}
elseif mode == 'pending' then
  while #out < count and total < budget do
    local r = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1, 'STREAMS', key, start)
    local es = r and r[1][2] or {}
    if #es == 0 then break end
    local e = es[1]
    start = e[1]
    if e[2] then
      take(start, e[2], times_delivered(start))
    else
      redis.call('XACK', key, group, start)  -- deleted while pending: nothing to redo
    end
  end
  return {start, out}
elseif mode == 'claim' then
  local calls, gone = 0, false
  while #out < count and total < budget and calls < count do
    calls = calls + 1
    local r = redis.call('XAUTOCLAIM', key, group, consumer, min_idle, start, 'COUNT', 1)
    start = r[1]
    for _, e in ipairs(r[2]) do
      if type(e) == 'table' and e[2] then
        take(e[1], e[2], times_delivered(e[1]))
      else
        gone = true
      end
    end
    if start == '0-0' then break end
  end
  if gone then
    -- Deleted while pending: Redis 6.2 answers nil and moves the entry to our PEL (7.0 drops it
    -- itself); ack it there so it does not pin trim_acked's MINID.
    for _, p in ipairs(redis.call('XPENDING', key, group, '-', '+', 1000, consumer)) do
      if #redis.call('XRANGE', key, p[1], p[1]) == 0 then redis.call('XACK', key, group, p[1]) end
    end
  end
  return {start, out}
else
  local cmd, stop = 'XRANGE', '+'
  if mode == 'revrange' then cmd, stop = 'XREVRANGE', '-' end
  while #out < count and total < budget do
    local es = redis.call(cmd, key, start, stop, 'COUNT', 1)
    if #es == 0 then break end
    local e = es[1]
    start = '(' .. e[1]
    take(e[1], e[2], 0)
  end
  return {start, out}
end
"""


class Scripts:
    """The scripts above on one client: each registered on first use (EVALSHA, loaded again when
    the server has lost it), and all of them off for good once the server refuses scripts."""

    def __init__(self, client: Any):
        self.r = client
        self.enabled = True  # False once the server refused EVALSHA (no @scripting): plain commands
        self._registered: dict[str, Any] = {}  # script source -> redis-py Script

    def run(self, source: str, keys: list[str], args: list[Any]) -> Any:
        """The reply of script `source` (one of the scripts above; a list), or None when the server
        refuses scripts, now or before: the caller then does the same with plain commands.

        Raises:
            NoPermissionError: refused for another reason (a key outside the user's patterns).
        """
        if not self.enabled:
            return None
        script = self._registered.get(source)
        if script is None:
            script = self._registered[source] = self.r.register_script(source)
        try:
            return script(keys=keys, args=args)
        except NoPermissionError as exc:
            self._refused(exc)
            return None

    def _refused(self, exc: NoPermissionError) -> None:
        """Fall back to plain commands when the server refuses scripts (no ACL +@scripting);
        re-raise any other permission error (a key outside the user's patterns)."""
        if "'eval" not in str(exc).lower() and "'script" not in str(exc).lower():
            raise exc
        log.warning(
            "Redis user may not run scripts (ACL +@scripting): stream reads are sized "
            "after the transfer, so one oversized entry costs its size in memory, and "
            "publish-if-owned is not atomic (%s)",
            exc,
        )
        self.enabled = False
