"""A mini-swe-agent environment whose commands run inside a Sprout sandbox.

It follows the protocol of mini-swe-agent's stock environments (LocalEnvironment): `execute`
returns output/returncode/exception_info and never raises except `Submitted`; each command runs in a
fresh `bash -lc` in `config.cwd`; template vars carry the sandbox's own `uname`, never the host's.
Unlike the stock docker environment, a timeout kills the command's whole process tree in the sandbox.
"""

from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel

from ..sandbox import Sandbox

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class SandboxEnvironmentConfig(BaseModel):
    cwd: str = ""
    env: dict[str, str] = {}
    timeout: int = 60
    max_output: int = 1 << 20


class SandboxEnvironment:
    def __init__(self, sandbox: Sandbox, **kwargs):
        self.sandbox = sandbox
        self.config = SandboxEnvironmentConfig(**kwargs)
        self.command_seconds = 0.0  # time spent in commands since the last reset (the journal reads it)
        self._uname: dict[str, str] | None = None

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        command = action.get("command", "")
        limit = timeout or self.config.timeout
        try:
            result = self.sandbox.exec(["bash", "-lc", command], cwd=cwd or self.config.cwd or None,
                                       env=self.config.env, timeout=limit, max_output=self.config.max_output)
            self.command_seconds += result.duration
            output = {"output": result.output, "returncode": result.exit_code, "exception_info": ""}
            if result.timed_out:
                output |= {"returncode": -1, "exception_info": (
                    f"An error occurred while executing the command: timed out after {limit} seconds "
                    "(the command and all its processes were killed)")}
        except Exception as e:  # the protocol: report, never raise
            output = {"output": "", "returncode": -1,
                      "exception_info": f"An error occurred while executing the command: {e}",
                      "extra": {"exception_type": type(e).__name__, "exception": str(e)}}
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict) -> None:
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def uname(self) -> dict[str, str]:
        """The sandbox's own uname, as platform.uname() names the fields."""
        if self._uname is None:
            keys = ("system", "node", "release", "version", "machine")
            result = self.sandbox.exec(["uname", "-s", "-n", "-r", "-v", "-m"])
            parts = result.output.strip().split(" ")
            # -v (version) contains spaces: system node release <version ...> machine
            values = [parts[0], parts[1], parts[2], " ".join(parts[3:-1]), parts[-1]] if len(parts) >= 5 else []
            self._uname = dict(zip(keys, values)) if values else dict.fromkeys(keys, "unknown")
        return self._uname

    def get_template_vars(self, **kwargs) -> dict[str, Any]:
        return recursive_merge(self.config.model_dump(), self.uname(), kwargs)

    def serialize(self) -> dict:
        return {"info": {"config": {
            "environment": self.config.model_dump(mode="json") | {"sandbox": self.sandbox.id},
            "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}"}}}
