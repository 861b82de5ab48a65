"""prometheus-client's multiprocess mode with series that can go: what a worker records into,
and what the supervisor reads.

Under `ttft-relay run --workers N` each worker writes its metrics into files in a shared
directory (`PROMETHEUS_MULTIPROC_DIR`), which the supervisor reads and sums at each scrape.
prometheus-client's own value class for this mode cannot forget a series: `remove()` only
warns, every key stays in the process's file and is read at every scrape, and every value
object stays in a list of the module's for the life of the process. So a bound on series
(`series.SeriesBound`) held nothing there: 780,017 series made a 179 MB scrape.

- `install(directory)` replaces prometheus-client's value class (`values.ValueClass`, the
  documented way to choose one, as for a custom process identifier) by `BoundedValue`. It
  writes the same files in the same format, named as prometheus-client names them (so
  `mark_process_dead` and `metrics.in_flight_of` work as before), holds no value its
  instrument dropped, and marks a dropped value's key dead where it is in the file (its
  timestamp `DEAD`: counters and histograms have none of their own). A file is rewritten
  without its dead keys once they outnumber the live ones four to one (to a new file, then
  renamed over the old: a scrape reads one or the other, whole). It must run before the
  process makes its first metric; writes come from one thread (the event loop), as
  prometheus-client's own class presumes.
- `registry(directory)` is what the supervisor serves: prometheus-client's reader with one
  line more, skipping dead keys (`_read_live_metrics`, pinned with the original).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import sys
import weakref
from pathlib import Path

from prometheus_client import CollectorRegistry, values
from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector

DEAD = -1.0
"""The timestamp of a key whose series went: the reader skips it."""
SLACK = 4096
"""Dead keys a file may hold besides four for each live one, before it is rewritten."""


class _File:
    """One of a process's files (one per kind: counter, histogram, gauge_livesum, ...)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.dict = MmapedDict(str(path))
        self.refs: dict[str, weakref.ref[BoundedValue]] = {}
        """The key of every value alive, to the value."""
        self.dead = 0
        self.rewrites = 0

    def register(self, key: str, value: BoundedValue) -> tuple[float, float]:
        """`value` is `key`'s from now on; its value and timestamp as the file holds them (0 for
        a key that was dead: the series starts again, as a new one would)."""
        if self.dead > 4 * len(self.refs) + SLACK:
            self.rewrite()
        self.refs[key] = weakref.ref(value, functools.partial(self._gone, key))
        number, timestamp = self.dict.read_value(key)
        if timestamp == DEAD:
            self.dead -= 1
            number, timestamp = 0.0, 0.0
            self.dict.write_value(key, number, timestamp)
        return number, timestamp

    def write(self, key: str, value: float, timestamp: float) -> None:
        self.dict.write_value(key, value, timestamp)

    def _gone(self, key: str, ref: weakref.ref[BoundedValue]) -> None:
        if sys.is_finalizing():
            return  # the process is ending, not the series: what it counted stays counted
        if self.refs.get(key) is not ref:
            return  # a newer value took the key meanwhile
        del self.refs[key]
        try:
            number, _ = self.dict.read_value(key)
            self.dict.write_value(key, number, DEAD)
        except (TypeError, ValueError):
            return  # the file is closed: the process is ending
        self.dead += 1

    def rewrite(self) -> None:
        """The file again, with the live keys only."""
        fresh = self.path.with_name(self.path.name + ".rewrite")  # not *.db: no reader takes it meanwhile
        fresh.unlink(missing_ok=True)
        new = MmapedDict(str(fresh))
        for key, ref in self.refs.items():
            if (value := ref()) is not None:
                new.write_value(key, value._value, value._timestamp)
        new.close()
        os.replace(fresh, self.path)
        self.dict.close()
        self.dict = MmapedDict(str(self.path))
        self.dead = 0
        self.rewrites += 1


_files: dict[str, _File] = {}
_directory: Path | None = None


class BoundedValue:
    """A float in a process's multiprocess file, as prometheus-client's `MmapedValue`, marked
    dead in the file once its instrument drops it."""

    _multiprocess = True
    __slots__ = ("_file", "_key", "_value", "_timestamp", "__weakref__")

    def __init__(self, typ: str, metric_name: str, name: str, labelnames, labelvalues, help_text: str,
                 multiprocess_mode: str = "", **kwargs) -> None:
        assert _directory is not None, "multiproc.install() first"
        prefix = f"{typ}_{multiprocess_mode}" if typ == "gauge" else typ
        file = _files.get(prefix)
        if file is None:
            file = _files[prefix] = _File(_directory / f"{prefix}_{os.getpid()}.db")
        self._file = file
        self._key = mmap_key(metric_name, name, labelnames, labelvalues, help_text)
        self._value, self._timestamp = file.register(self._key, self)

    def inc(self, amount: float) -> None:
        self._value += amount
        self._timestamp = 0.0
        self._file.write(self._key, self._value, self._timestamp)

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value
        self._timestamp = timestamp or 0.0
        self._file.write(self._key, self._value, self._timestamp)

    def set_exemplar(self, exemplar: object) -> None:
        return  # as prometheus-client's: no exemplars in multiprocess mode

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> None:
        return None


def install(directory: str | Path) -> None:
    """Metrics made from now on in this process record into `directory` with `BoundedValue`."""
    global _directory
    if values.ValueClass is not BoundedValue:
        _directory = Path(directory)
        values.ValueClass = BoundedValue


def files() -> dict[str, _File]:
    """This process's files, by kind (for tests)."""
    return _files


class LiveCollector(MultiProcessCollector):
    """prometheus-client's collector of a multiprocess directory, without dead keys."""

    def collect(self):
        files = glob.glob(os.path.join(self._path, "*.db"))
        return MultiProcessCollector._accumulate_metrics(_read_live_metrics(files), True)


def registry(directory: str | Path) -> CollectorRegistry:
    """A registry that reads what every process wrote into `directory`, live series only."""
    reg = CollectorRegistry()
    LiveCollector(reg, path=str(directory))
    return reg


def _read_live_metrics(files):
    # prometheus-client 0.26.0's MultiProcessCollector._read_metrics, with the one line marked.
    metrics = {}
    key_cache = {}

    def _parse_key(key):
        val = key_cache.get(key)
        if not val:
            metric_name, name, labels, help_text = json.loads(key)
            labels_key = tuple(sorted(labels.items()))
            val = key_cache[key] = (metric_name, name, labels, labels_key, help_text)
        return val

    for f in files:
        parts = os.path.basename(f).split('_')
        typ = parts[0]
        try:
            file_values = MmapedDict.read_all_values_from_file(f)
        except FileNotFoundError:
            if typ == 'gauge' and parts[1].startswith('live'):
                continue
            raise
        for key, value, timestamp, _ in file_values:
            if timestamp == DEAD and typ != 'gauge':  # the line more: a series that went
                continue
            metric_name, name, labels, labels_key, help_text = _parse_key(key)

            metric = metrics.get(metric_name)
            if metric is None:
                metric = Metric(metric_name, help_text, typ)
                metrics[metric_name] = metric

            if typ == 'gauge':
                pid = parts[2][:-3]
                metric._multiprocess_mode = parts[1]
                metric.add_sample(name, labels_key + (('pid', pid),), value, timestamp)
            else:
                metric.add_sample(name, labels_key, value)
    return metrics
