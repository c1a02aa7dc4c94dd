"""What an engine shows of its decisions: metrics (`metrics`), the token trace
(`trace`), and `outrate top` (`top`, with its scrape `fetch`; imported on its
own: it needs rich and prometheus_client's parser)."""

from outrate.observe.metrics import Metrics
from outrate.observe.trace import TraceWriter, read_trace

__all__ = ["Metrics", "TraceWriter", "read_trace"]
