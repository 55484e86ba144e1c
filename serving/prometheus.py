"""The Prometheus exposition of `ember serve`'s figures and of the `serve --ray` front's, through `prometheus_client`:
the families are built from a snapshot at each scrape (the scheduler's counts, the router's), never kept as live
metric objects, so a scrape reads one consistent state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

# The content type of the text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


Samples = Iterable[tuple[Sequence[str], float]]  # (label values, value) per sample


def counter(name: str, helptext: str, samples: Samples, labels: Sequence[str] = ()) -> Metric:
    """A counter family (`name` ends in `_total`) of one sample per label values."""
    return _filled(CounterMetricFamily(name, helptext, labels=list(labels)), samples)


def gauge(name: str, helptext: str, samples: Samples, labels: Sequence[str] = ()) -> Metric:
    """A gauge family of one sample per label values."""
    return _filled(GaugeMetricFamily(name, helptext, labels=list(labels)), samples)


def _filled(family: CounterMetricFamily | GaugeMetricFamily, samples: Samples) -> Metric:
    for values, value in samples:
        family.add_metric(list(values), value)
    return family


def histogram(name: str, helptext: str, bounds: Sequence[float], counts: Sequence[int], total: float) -> Metric:
    """A histogram family from per-bucket counts (observations at or below each bound, the last past them all)."""
    cumulative, buckets = 0, []
    for bound, count in zip((*map(str, bounds), "+Inf"), counts):
        cumulative += count
        buckets.append((bound, cumulative))
    return HistogramMetricFamily(name, helptext, buckets=buckets, sum_value=total)


def labelled(text: str, label: str, value: str) -> list[Metric]:
    """The families of another exposition (`text`), each sample with `label="value"` added."""
    families = []
    for parsed in text_string_to_metric_families(text):
        family = Metric(parsed.name, parsed.documentation, parsed.type)
        for sample in parsed.samples:
            family.add_sample(sample.name, {label: value, **sample.labels}, sample.value)
        families.append(family)
    return families


def merged(families: Iterable[Metric]) -> list[Metric]:
    """`families` with those of one name made one (each source's samples in turn), in order of first appearance."""
    by_name: dict[str, Metric] = {}
    for family in families:
        if family.name not in by_name:
            by_name[family.name] = Metric(family.name, family.documentation, family.type)
        by_name[family.name].samples.extend(family.samples)
    return list(by_name.values())


class _Snapshot:
    """A collector that yields families already built."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def exposition(families: Sequence[Metric]) -> str:
    """The text exposition of `families`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(families))
    return generate_latest(registry).decode("utf-8")
