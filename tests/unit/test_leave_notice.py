"""regions/leave_notice.py: a SIGTERM to a region's process marks it as leaving, ends the process
when the grace runs out, and once the region is closed goes to the handler that was there before
(an orderly shutdown stays one). Real signals to this process, the handler put back after each."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from geofed.regions.leave_notice import LeaveNotice


@pytest.fixture
def before():
    """A recording handler in place of pytest's, restored after the test."""
    got: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    yield got
    signal.signal(signal.SIGTERM, old)


def _deliver() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)  # the handler runs on the main thread at its next bytecode


def test_a_sigterm_marks_the_region_leaving_and_the_grace_ends_the_process(before):
    ended = threading.Event()
    notice = LeaveNotice(0.3, exit=ended.set)
    assert notice.record() == {} and not notice.leaving
    assert notice.install()
    _deliver()
    assert notice.leaving and before == []  # Ray's handler (here: the recorder) is not called: the process stays
    assert notice.record()["leaving"] is True and 0 < notice.record()["grace_left_s"] <= 0.3
    first = notice.since
    _deliver()
    assert notice.since == first  # a repeated notice changes nothing
    assert ended.wait(3)  # the grace ran out in the middle of a round: the process ends
    assert notice.record()["grace_left_s"] == 0


def test_once_closed_a_sigterm_is_an_orderly_shutdown(before):
    ended = threading.Event()
    notice = LeaveNotice(0.2, exit=ended.set)
    assert notice.install()
    _deliver()
    notice.close()  # retired (or the run ended) within the grace: no exit of its own
    assert not ended.wait(0.4) and not notice.leaving
    _deliver()
    assert before == [signal.SIGTERM]  # the handler before it (Ray's: the worker exits)


def test_only_the_main_thread_installs_it():
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(LeaveNotice(1).install()))
    thread.start()
    thread.join()
    assert got == [False]


def test_a_reopened_notice_is_a_notice_again_with_the_new_grace(before):
    """A pooled actor adopted by the next run (regions/actor.py adopt): its notice was closed at the
    last run's end; reopened, a SIGTERM marks it leaving instead of going to Ray's handler."""
    ended = threading.Event()
    notice = LeaveNotice(0.2, exit=ended.set)
    assert notice.install()
    notice.close()
    notice.reopen(5.0)
    _deliver()
    assert before == [] and notice.leaving and not ended.is_set()
    assert 4.5 < notice.record()["grace_left_s"] <= 5.0
    notice.close()
