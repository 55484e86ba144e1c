"""ember past one machine: replicas of the serving engine on a Ray cluster behind one OpenAI endpoint.

`ember serve ARTIFACT --ray [ADDRESS] --replicas N` (the `cluster` extra: pip install 'ember[cluster]'),
and `ember serve PIPELINE --ray [ADDRESS]` for a model split into pipeline stages.

    router.py   which replica answers a request: the one whose prefix cache holds its prompt's start, else
                the least loaded (pure Python, no Ray)
    replica.py  a replica: a Ray actor process running `ember serve`'s own server over its own engine, and
                the pool that starts, watches and replaces them
    front.py    the endpoint: an HTTP proxy that routes each request to a replica and relays its answer
                whole, retrying elsewhere when a replica dies before answering; /health and /metrics per replica
    pipeline.py `ember serve PIPELINE --ray`: a split model's stages (compile --pipeline-stages) as one actor
                each, chained as one engine under `ember serve`'s own scheduler and server

Only the CLI imports this package, lazily: the runtime and the compiler never import Ray.
"""
