"""What every process reads: the `EngineSettings` record the API server sends
the engine core (`settings`), vLLM's configuration turned into outrate's and
checked (`config`), which vLLM this is (`versions`), the patch index
(`patches`) and where each of its targets lives on this vLLM (`compat`)."""
