import verifiers.v1 as vf

from vf_tiny_tools.servers.tool import CalcToolset


class TinyToolsData(vf.TaskData):
    a: int
    b: int


class TinyToolsTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()
    max_tool_calls: int = 3


class TinyToolsTask(vf.Task[TinyToolsData, vf.State, TinyToolsTaskConfig]):
    @classmethod
    def toolsets(cls, config: TinyToolsTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == str(self.data.a + self.data.b))

    @vf.reward(weight=0.25)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(any(m.name == "calc_add" for m in trace.tool_messages))

    @vf.stop
    def enough_calls(self, trace: vf.Trace) -> bool:
        return len(trace.tool_messages) >= self.config.max_tool_calls


class TinyToolsConfig(vf.TasksetConfig):
    num_tasks: int = 40
    task: TinyToolsTaskConfig = TinyToolsTaskConfig()


class TinyToolsTaskset(vf.Taskset[TinyToolsTask, TinyToolsConfig]):
    def load(self) -> list[TinyToolsTask]:
        return [
            TinyToolsTask(
                TinyToolsData(prompt=f"What is {i} + {2 * i + 1}? Use the tools.", a=i, b=2 * i + 1),
                self.config.task,
            )
            for i in range(self.config.num_tasks)
        ]
