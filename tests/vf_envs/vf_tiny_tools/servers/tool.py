import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)

    @vf.tool
    async def negate(self, x: int) -> str:
        """The integer with its sign flipped."""
        return str(-x)


if __name__ == "__main__":
    CalcToolset.run()
