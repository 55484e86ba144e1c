"""ember past one machine: replicas of the serving engine on a Ray cluster behind one OpenAI endpoint.

`ember serve ARTIFACT --ray [ADDRESS] --replicas N` (the `cluster` extra: pip install 'ember[cluster]').

    router.py   which replica answers a request: the one whose prefix cache holds its prompt's start, else
                the least loaded (pure Python, no Ray)
    replica.py  a replica: a Ray actor process running `ember serve`'s own server over its own engine, and
                the pool that starts, watches and replaces them
    front.py    the endpoint: an HTTP proxy that routes each request to a replica and relays its answer
                whole, retrying elsewhere when a replica dies before answering; /health and /metrics per replica

Only the CLI imports this package, lazily: the runtime and the compiler never import Ray.
"""
