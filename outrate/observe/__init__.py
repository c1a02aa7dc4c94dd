"""What an engine shows of its decisions: the counts (`metrics`), their way to
/metrics (`publish`), the token trace (`trace`), and `outrate top` (`top`, the
screen, over `scrape`, which parses what `fetch` read; imported on its own:
it needs rich and prometheus_client's parser)."""

from outrate.observe.metrics import Metrics
from outrate.observe.trace import TraceWriter, read_trace

__all__ = ["Metrics", "TraceWriter", "read_trace"]
