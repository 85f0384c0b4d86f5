"""The streaming client the HTTP benchmarks share (stdlib only): POST a JSON body to an
OpenAI-compatible route and yield each SSE event's JSON as it arrives, `[DONE]` excluded."""
import json
import time
import urllib.request


def events(url, body):
    """Yields the parsed `data:` events of one streamed answer to `body` (a dict) at `url`."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                yield json.loads(line[5:])


def text_times(url, body):
    """The arrival time (`time.perf_counter`) of each event of the answer that carries text."""
    return [time.perf_counter() for ev in events(url, body)
            if any(c.get("text") for c in ev.get("choices") or [])]
