"""Elapsed time and an estimate of the time left while the suite runs: a
line at every tenth of the tests, from the rate so far (with `-n 2` the
controller hears of each test as a worker finishes it)."""

from __future__ import annotations

import time

import pytest

from curvbench.runs import duration


class TimeLeft:
  """Counts finished tests and says, at each tenth, how long so far and
  about how long is left."""

  def __init__(self, reporter):
    self.reporter = reporter
    self.start = time.perf_counter()
    self.total = 0
    self.done = 0
    self.tenth = 1

  def finished(self) -> None:
    self.done += 1
    if not self.total or self.done >= self.total:
      return
    if self.done * 10 < self.tenth * self.total:
      return
    self.tenth = self.done * 10 // self.total + 1
    elapsed = time.perf_counter() - self.start
    left = elapsed * (self.total - self.done) / self.done
    self.reporter.write_line(
      f"tests: {self.done}/{self.total} done in {duration(elapsed)}, "
      f"about {duration(left)} left (from the rate so far)"
    )


# The controller's counter (none in an xdist worker, which reports nothing).
_counter: list[TimeLeft] = []


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
  reporter = config.pluginmanager.getplugin("terminalreporter")
  if reporter is not None and not hasattr(config, "workerinput"):
    _counter[:] = [TimeLeft(reporter)]


def pytest_collection_finish(session):
  if _counter and session.items:
    _counter[0].total = len(session.items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
  if _counter:
    _counter[0].total = max(_counter[0].total, len(ids))


def pytest_runtest_logreport(report):
  if _counter and report.when == "teardown":
    _counter[0].finished()
