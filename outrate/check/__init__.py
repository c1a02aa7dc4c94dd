"""`outrate lint`: a deployment described without importing vLLM
(`deployment`, with `vllm serve` flags and `--config` read by `serve_args`),
the rules it must meet (`rules`), and the lint of a policy
with its deployment (`lint`)."""

from outrate.check.deployment import Deployment, load_deployment
from outrate.check.lint import LintReport, lint_all
from outrate.check.rules import Finding

__all__ = ["Deployment", "Finding", "LintReport", "lint_all", "load_deployment"]
