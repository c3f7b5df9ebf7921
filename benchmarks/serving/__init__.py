"""How fast requests are served: scenarios over HTTP on the load generator (multi-turn chat, a long
prompt among running streams) and the engine measured in process (offline throughput, a decode
step's breakdown, the token budget, structured outputs, tensor parallelism)."""
