"""lockstep with tenants, through the official openai client: its api_key is what lockstep checks
(Authorization: Bearer); a wrong key surfaces as openai.AuthenticationError with lockstep's code."""
import os

import openai

url, model = os.environ["LOCKSTEP_URL"], os.environ["LOCKSTEP_MODEL"]
ok = openai.OpenAI(base_url=url + "/v1", api_key="acme-key", max_retries=0)
r = ok.completions.create(model=model, prompt="red green blue", max_tokens=2)
assert r.choices[0].text, r
bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
try:
    bad.completions.create(model=model, prompt="x", max_tokens=2)
    raise SystemExit("a wrong key was accepted")
except openai.AuthenticationError as e:
    assert e.status_code == 401 and e.code == "invalid_api_key", e
print("TENANT CHECKS OK")
