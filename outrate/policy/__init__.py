"""The policy path, one way: file (`file`) -> YAML with positions (`compose`)
-> `Policy` (`loader`, `model`, `values`) -> `CompiledPolicy` (`compiler`),
joined by `pipeline`; the models' parts are `specs` and `sections`, compose's
`scalars` and `parse_limits`; `keys` is the api_key identity's keys file; `reload`
(with its `watch`er) and `changes` swap a new policy in and say what changed."""

from outrate.policy.compiler import CompiledPolicy, compile_policy
from outrate.policy.model import Policy
from outrate.policy.pipeline import load_compiled, policy_from_flags

__all__ = ["CompiledPolicy", "Policy", "compile_policy", "load_compiled", "policy_from_flags"]
