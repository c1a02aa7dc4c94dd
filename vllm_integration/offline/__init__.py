"""Away from a served engine: `outrate simulate`'s engine on a virtual clock
(`simulator`)."""
