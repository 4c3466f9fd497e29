"""launch/torchrun.sh's stderr filter (grpo_dist.tools.torchrun_stderr): torchrun's own traceback when a signal stops
it, and a logging error inside torch.distributed.elastic, are dropped; every other line, worker tracebacks included,
passes in order. The texts are torchrun 2.13's, trimmed."""

import pytest

from grpo_dist.tools.torchrun_stderr import filter_lines

pytestmark = pytest.mark.fast

ELASTIC = "/venv/lib/python3.11/site-packages/torch/distributed/elastic"
AGENT_TRACEBACK = f"""Traceback (most recent call last):
  File "{ELASTIC}/agent/server/api.py", line 745, in run
    result = self._invoke_run(role)
             ^^^^^^^^^^^^^^^^^^^^^^
  File "{ELASTIC}/multiprocessing/api.py", line 86, in _terminate_process_handler
    raise SignalException(f"Process {{os.getpid()}} got signal: {{sigval}}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 16764 got signal: 2

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "{ELASTIC}/multiprocessing/api.py", line 86, in _terminate_process_handler
    raise SignalException(f"Process {{os.getpid()}} got signal: {{sigval}}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 16764 got signal: 2
"""
LOGGING_ERROR = f"""--- Logging error ---
Traceback (most recent call last):
  File "/usr/lib/python3.11/logging/__init__.py", line 1110, in emit
    msg = self.format(record)
KeyError: 'rank'
Call stack:
  File "{ELASTIC}/agent/server/api.py", line 753, in run
    logger.warning("Received %s death signal, shutting down workers", e.sigval)
Message: 'Received %s death signal, shutting down workers'
Arguments: (<Signals.SIGINT: 2>,)
"""
WORKER_TRACEBACK = """Traceback (most recent call last):
  File "/work/my_rewards.py", line 3, in reward
    return 1 / 0
ZeroDivisionError: division by zero
"""
LAST = "[grpo_dist] stop requested: checkpoint written at step 3, exiting with code 75\n"


def lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def test_torchruns_signal_traceback_and_logging_error_are_dropped_the_rest_passes_in_order():
    before = "W1204 api.py:753] Received 2 death signal, shutting down workers\n"
    text = before + WORKER_TRACEBACK + LAST + LOGGING_ERROR + AGENT_TRACEBACK
    assert list(filter_lines(lines(text))) == lines(before + WORKER_TRACEBACK + LAST)


def test_a_line_after_a_traceback_is_kept_and_a_worker_logging_error_passes():
    after = "torchrun.sh: done\n"
    worker_logging = LOGGING_ERROR.replace(ELASTIC, "/work/my_code")
    assert list(filter_lines(lines(AGENT_TRACEBACK + "\n" + after))) == ["\n", after]
    assert list(filter_lines(lines(WORKER_TRACEBACK + "\n" + after))) == lines(WORKER_TRACEBACK + "\n" + after)
    assert list(filter_lines(lines(worker_logging))) == lines(worker_logging)
    cut = WORKER_TRACEBACK.splitlines(keepends=True)[:2]  # a traceback cut off by the end of the stream
    assert list(filter_lines(cut)) == cut
