"""The API server process: request guards on the OpenAI routes and the one
door to the engine (`guards`), who is asking (`identity`), and the engine
core's metrics served on vLLM's `/metrics` (`metrics`). Each installs itself
from the plugin at startup."""
