"""When a process starts: the `vllm.general_plugins` entry points
(`plugin.register`, `plugin.register_cpu_fixes`), `outrate serve`'s launcher,
the flag lists lint reads (`flags`), the CPU platform fixes (`cpu_amx`,
`cpu_spin`) and `outrate doctor` (`doctor`)."""
