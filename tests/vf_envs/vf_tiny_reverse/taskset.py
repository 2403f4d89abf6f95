import random

import verifiers.v1 as vf

WORDS = ("cat", "dog", "sun", "map", "pen", "cup", "box", "hat", "owl", "ant", "fig", "jam")


class TinyReverseData(vf.TaskData):
    answer: str


class TinyReverseTask(vf.Task[TinyReverseData]):
    @vf.reward(weight=1.0)
    async def reversed_exactly(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.5)
    async def short_reply(self, task: TinyReverseData, trace: vf.Trace) -> float:
        # reads the task by parameter name: verifiers passes what a scoring function names
        return float(len(trace.last_reply) <= 2 * len(task.answer))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class TinyReverseConfig(vf.TasksetConfig):
    num_tasks: int = 40
    """How many words (pairs of WORDS, drawn from `seed`)."""
    seed: int = 0


class TinyReverseTaskset(vf.Taskset[TinyReverseTask, TinyReverseConfig]):
    def load(self) -> list[TinyReverseTask]:
        rng = random.Random(self.config.seed)
        words = [rng.choice(WORDS) + rng.choice(WORDS) for _ in range(self.config.num_tasks)]
        return [
            TinyReverseTask(
                TinyReverseData(
                    prompt=f"Reverse: {w}",
                    system_prompt="Reply with the letters in reverse order only.",
                    answer=w[::-1],
                ),
                self.config.task,
            )
            for w in words
        ]
