"""What clients are told about their limits: the request rate decided before
a request reaches the engine (`requests`), and the rate-limit header fields
every guarded response carries (`headers`). Pure: the API server
(vllm_integration/apiserver/guards.py) calls them. docs/client-contract.md."""
