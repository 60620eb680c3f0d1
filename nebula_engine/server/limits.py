"""Size limits of the HTTP API (a module of constants, so the CLI can show them without importing the server)."""

# Room for the longest context of any family served (Qwen3.5: 262,144 tokens) sent in its densest JSON form,
# token ids at 8 bytes each (2 MiB), and as much again for the rest of the body. Text is smaller: 4.3 bytes per
# token on average, 6.2 at most, measured with the Qwen tokenizer on the SWE-agent and ChatDev traces.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
