"""The embedded SGLang-compatible rollout engine: a CPU stand-in for an SGLang server.

    server.py            aiohttp app: SGLang's native HTTP endpoints, batching, `megatron-rl serve`
    generation.py        the generation core (HF causal LM, batched KV-cache decode, SGLang sampling)
    validation.py        /generate body validation
    http.py              API key, bounded body reading, off-loop JSON
    compat.py            the SGLang version it stands in for (--sglang-compat): sessions, version reporting
    weight_endpoints.py  weight-update endpoints (groups, distributed, tensor, memory occupation)
    weight_receiver.py   staged, verified weight swaps
    weight_groups.py     weight-update process groups (/init_weights_update_group, broadcasts)
    tensor_payload.py    decoding of /update_weights_from_tensor payloads
    testing.py           tiny models/tokenizers and a threaded server for tests

The client side (HTTP client, launchers, topology, weight-sync transports) lives in rollout/; the
two share only the wire protocol. Importing this package is cheap: submodules are imported on use.
"""
