"""A tiny multi-turn verifiers (0.4, `verifiers.v1`) environment for the tests: add two numbers
with a tool. Laid out as `vf init vf-tiny-tools --add-tool` scaffolds a package (the toolset in
`servers/tool.py`, constructed in `Task.toolsets`)."""

from vf_tiny_tools.taskset import TinyToolsTaskset

__all__ = ["TinyToolsTaskset"]
