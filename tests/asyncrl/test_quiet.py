"""What the user-facing commands (`asyncrl demo`, `asyncrl run`) leave on the terminal: their own
lines only. The model tools' output (transformers' progress bars and warnings) goes to a log file,
libraries' INFO lines of in-process work (alembic migrating the demo's ledger) nowhere, and the
services keep their own INFO but not alembic's per-start chatter."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncrl.demo import TOOL_ENV, prepare_model, run_tool

# What third-party libraries write when left alone (the demo's terminal before this was fixed).
THIRD_PARTY = (
    "Loading weights",
    "Writing model shards",
    "it/s]",
    "%|",
    "\r",
    "Warning",
    "WARNING",
    "INFO",
    "setup plugin",
    "Context impl",
    "non-transactional DDL",
)

CHATTY_TOOL = textwrap.dedent("""
    import logging, os, sys, warnings
    logging.basicConfig(level=logging.INFO)
    sys.stderr.write("Loading weights: 100%|##########| 21/21 [00:00<00:00, 10211.03it/s]\\r\\n")
    logging.getLogger("alembic.runtime.plugins").info("setup plugin alembic.autogenerate.schemas")
    warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning)
    print("result", os.environ.get("TQDM_DISABLE"), os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"))
""")


def _terminal(capfd: pytest.CaptureFixture[str]) -> str:
    out, err = capfd.readouterr()
    return out + err


def test_a_tools_chatter_goes_to_its_log_and_its_stdout_to_the_caller(tmp_path, capfd):
    log = tmp_path / "logs" / "model.log"
    out = run_tool([sys.executable, "-c", CHATTY_TOOL], log, "the chatty tool")
    assert _terminal(capfd) == ""
    assert out == "result 1 1\n"  # progress bars off in the tool (TOOL_ENV), for a readable log
    assert set(TOOL_ENV) == {"TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"}
    text = log.read_text()
    for line in ("$ " + sys.executable + " -c", "Loading weights: 100%", "setup plugin", "FutureWarning", "result 1 1"):
        assert line in text
    run_tool([sys.executable, "-c", "print('second')"], log, "another tool")
    assert log.read_text().startswith(text) and log.read_text().endswith("second\n")  # appended


def test_a_failed_tool_raises_with_its_log_and_its_tail(tmp_path, capfd):
    log = tmp_path / "model.log"
    with pytest.raises(RuntimeError) as err:
        run_tool([sys.executable, "-c", "import sys; sys.exit('no such model: /nowhere')"], log, "the warm start")
    assert _terminal(capfd) == ""
    message = str(err.value)
    assert message.startswith(f"the warm start failed (exit 1); last lines of {log}:") and "no such model" in message


@pytest.mark.slow
def test_preparing_the_demo_model_prints_only_its_own_lines(tmp_path, capfd):
    """The real tools (transformers writes and loads the model with progress bars), a short warm start."""
    log = tmp_path / "logs" / "model.log"
    warm = prepare_model(tmp_path, 0, log_path=log, warm_args=("--steps", "2", "--n-train", "16", "--n-test", "4"))
    assert (warm / "config.json").exists()
    lines = _terminal(capfd).splitlines()
    assert len(lines) == 3, lines
    assert lines[0] == f"building tiny model -> {tmp_path / 'tiny-base'}"
    assert lines[1] == f"supervised warm start -> {warm} (a minute or two; log {log})"
    assert lines[2].startswith("warm start: held-out greedy accuracy ") and "pass@8" in lines[2]
    assert not [w for w in THIRD_PARTY if any(w in line for line in lines)]
    text = log.read_text()
    assert "asyncrl.tiny_model" in text and "parameters)" in text and '"greedy_acc"' in text
    assert "it/s]" not in text  # TOOL_ENV: no progress bars in the log either
    prepare_model(tmp_path, 0, log_path=log)  # both cached: nothing to do, nothing to say
    assert _terminal(capfd) == ""


def _python(code: str) -> str:
    """Run `code` in a fresh interpreter (its own logging set-up); its stdout and stderr."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_the_commands_migrating_a_ledger_print_nothing(tmp_path):
    """`asyncrl demo` migrates its fresh SQLite ledger in-process (cancel_leftovers)."""
    out = _python(f"""
        from asyncrl.cli import quiet_logging
        from broker.ledger import Ledger
        quiet_logging()
        Ledger("sqlite:///{tmp_path / "ledger.db"}").close()
        print("done")
    """)
    assert out == "done\n"


def test_a_services_log_keeps_its_info_but_not_alembics(tmp_path):
    out = _python(f"""
        import logging
        from shared.logs import setup_logging
        from broker.ledger import Ledger
        setup_logging("trainer", "INFO")
        Ledger("sqlite:///{tmp_path / "ledger.db"}").close()
        Ledger("sqlite:///{tmp_path / "ledger.db"}").close()  # at head: no line
        logging.getLogger("trainer_svc.train").info("step 1: reward 0.5")
    """)
    lines = out.splitlines()
    assert len(lines) == 2, lines
    assert (
        "INFO service=trainer" in lines[0] and "broker.ledger.engine: ledger schema migrated from empty to " in lines[0]
    )
    assert lines[1].endswith("trainer_svc.train: step 1: reward 0.5")
