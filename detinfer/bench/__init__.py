"""``detinfer bench``: the benchmark suite (side by side with llama.cpp), memory bandwidth, KV-cache and
constraint figures, and the report writer. A user command, like llama-bench; nothing else imports it."""
