"""The policy path, one way: file (`file`) -> YAML with positions (`compose`)
-> `Policy` (`loader`, `model`, `values`) -> `CompiledPolicy` (`compiler`),
joined by `pipeline`; `keys` is the api_key identity's keys file; `reload`
and `changes` swap a new policy in and say what changed."""

from outrate.policy.compiler import CompiledPolicy, compile_policy
from outrate.policy.model import Policy
from outrate.policy.pipeline import load_compiled, policy_from_flags

__all__ = ["CompiledPolicy", "Policy", "compile_policy", "load_compiled", "policy_from_flags"]
