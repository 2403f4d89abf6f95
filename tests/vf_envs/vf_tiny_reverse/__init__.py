"""A tiny single-turn verifiers (0.4, `verifiers.v1`) environment for the tests: reverse a word.

Laid out as `vf init vf-tiny-reverse` scaffolds a package: the taskset in `taskset.py`, exported
by `__all__`, so `verifiers.v1.load_taskset` finds it by its module name.
"""

from vf_tiny_reverse.taskset import TinyReverseTaskset

__all__ = ["TinyReverseTaskset"]
