"""`/v1/embeddings` through the clients people use, against lockstep's embedded engine with
`[models.engine] embeddings = true`, or its `[models.embed]` workers (the SGLang and vLLM mock,
with LOCKSTEP_EMBED_DIM set to the mock's dimensions): the official openai package (its default base64 encoding
and `encoding_format="float"`, which must agree), langchain-openai's OpenAIEmbeddings (with
`check_embedding_ctx_length=False`: otherwise it sends tiktoken's ids, which are not this model's)
and litellm. Run by tests/tests/embeddings.rs in the clients' own virtual environment with
LOCKSTEP_URL and LOCKSTEP_MODEL set; exits non-zero on the first failed check."""

import math
import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from GitHub at import

import litellm
import openai
from langchain_openai import OpenAIEmbeddings

URL = os.environ["LOCKSTEP_URL"]
MODEL = os.environ["LOCKSTEP_MODEL"]
DIM = int(os.environ.get("LOCKSTEP_EMBED_DIM") or 576)
REMOTE = "LOCKSTEP_EMBED_DIM" in os.environ


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


def close(a, b):
    return len(a) == len(b) and all(abs(x - y) < 1e-5 for x, y in zip(a, b))


texts = ["The capital of France is Paris.", "A cat sat on the mat."]
oa = openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0, timeout=60)
r = oa.embeddings.create(model=MODEL, input=texts)  # base64 on the wire, decoded by the client
vecs = [d.embedding for d in r.data]
check([d.index for d in r.data] == [0, 1] and all(len(v) == DIM for v in vecs), "openai: one vector per input")
check(all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-3 for v in vecs), "unit length")
check(r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens, f"usage {r.usage}")
f = oa.embeddings.create(model=MODEL, input=texts, encoding_format="float")
check(all(close(a.embedding, b) for a, b in zip(f.data, vecs)), "float and base64 agree")
one = oa.embeddings.create(model=MODEL, input=texts[0]).data[0].embedding
check(close(one, vecs[0]), "one input alone gives the same vector")
try:
    oa.embeddings.create(model=MODEL, input=texts, dimensions=3)
    check(False, "dimensions other than the model's are refused")
except openai.BadRequestError as e:
    # The engine refuses by name; an embedding worker that is not Matryoshka refuses itself.
    check(REMOTE or e.body.get("param") == "dimensions", f"dimensions refused: {e.body}")

lc = OpenAIEmbeddings(base_url=URL + "/v1", api_key="unused", model=MODEL, check_embedding_ctx_length=False,
                      max_retries=0)
docs = lc.embed_documents(texts)
check(len(docs) == 2 and all(close(a, b) for a, b in zip(docs, vecs)), "langchain embed_documents")
check(close(lc.embed_query(texts[0]), vecs[0]), "langchain embed_query")

r = litellm.embedding(model="openai/" + MODEL, api_base=URL + "/v1", api_key="unused", input=texts)
check(all(close(d["embedding"], v) for d, v in zip(r.data, vecs)), "litellm embedding")

print("all embedding client checks passed")
