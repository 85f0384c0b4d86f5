//! The check of what a vLLM prefill returned for the decode: its `kv_transfer_params`.

use serde_json::Value;

use lockstep_core::config::{VllmConnector, VllmSection};

/// Checks the transfer params a prefill returned for `prompt_tokens` tokens.
///
/// vLLM 0.33's NIXL connector returns `remote_block_ids` as one list per KV-cache group
/// (`BlockIds = tuple[list[int], ...]`, `vllm/distributed/kv_transfer/kv_connector/utils.py`;
/// `nixl/pull_scheduler.py` `request_finished`): `[[4, 9, 2]]` for a dense model. Earlier
/// releases sent one flat list, still accepted. Block ids are unique within a group only
/// (`v1/core/sched/scheduler.py`). A full-attention group covers every computed token;
/// sliding-window and SSM groups hold fewer blocks (`base_scheduler.py`), never more, so at
/// least one group must cover the tokens and none may hold more than that. The computed token
/// count is `remote_num_tokens` when sent (0.33: the prompt, less a backoff of at most one
/// block for MTP and mamba models), else the prompt.
pub(super) fn check_params(
    cfg: &VllmSection,
    p: Option<&Value>,
    prompt_tokens: u64,
    request_id: &str,
    prefill_host: &str,
) -> Result<(), String> {
    let p = p
        .filter(|p| p.is_object())
        .ok_or("the prefill returned no kv_transfer_params")?;
    let ids = p
        .get("remote_block_ids")
        .and_then(Value::as_array)
        .ok_or("kv_transfer_params.remote_block_ids missing or not a list")?;
    let groups: Vec<&Vec<Value>> = if ids.iter().all(Value::is_array) && !ids.is_empty() {
        ids.iter().filter_map(Value::as_array).collect()
    } else {
        vec![ids]
    };
    let bs = cfg.block_size.max(1);
    let tokens = match p.get("remote_num_tokens") {
        None | Some(Value::Null) => prompt_tokens,
        Some(v) => {
            let n = v
                .as_u64()
                .ok_or("kv_transfer_params.remote_num_tokens is not an integer")?;
            if n > prompt_tokens || n + bs < prompt_tokens {
                return Err(format!(
                    "kv_transfer_params.remote_num_tokens {n} for a prompt of {prompt_tokens} tokens"
                ));
            }
            n
        }
    };
    let (full, all) = (tokens / bs, tokens.div_ceil(bs));
    let mut covered = false;
    for (g, group) in groups.iter().enumerate() {
        let mut seen = std::collections::HashSet::with_capacity(group.len());
        for id in group.iter() {
            let id = id
                .as_u64()
                .ok_or("kv_transfer_params.remote_block_ids holds a non-integer")?;
            if !seen.insert(id) {
                return Err(format!(
                    "kv_transfer_params.remote_block_ids names block {id} twice in group {g}"
                ));
            }
        }
        let n = group.len() as u64;
        if n > all {
            return Err(format!(
                "{n} remote blocks in group {g} for {tokens} tokens of block size {bs} (at most {all})"
            ));
        }
        covered |= n == full || n == all;
    }
    if !covered {
        return Err(format!(
            "no KV-cache group of remote_block_ids covers the {tokens} prompt tokens: block size {bs} needs {full} or {all} blocks"
        ));
    }
    if p.get("remote_engine_id")
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
    {
        return Err("kv_transfer_params.remote_engine_id missing".into());
    }
    if cfg.connector == VllmConnector::Nixl {
        // vLLM 0.33's decode needs the prefill's engine request id to pull and to release
        // the blocks (`nixl/pull_scheduler.py`); without it the decode silently recomputes and
        // the prefill holds its blocks until the lease ends. vLLM forms it from the
        // X-Request-Id lockstep sent (`cmpl-<id>-<choice>-<suffix>`,
        // `entrypoints/openai/completion/serving.py`): another request's id is a cross-wired
        // answer.
        match p.get("remote_request_id").and_then(Value::as_str) {
            None | Some("") => {
                return Err("kv_transfer_params.remote_request_id missing".into());
            }
            Some(r) if !r.split('-').any(|part| part == request_id) => {
                return Err(format!(
                    "kv_transfer_params.remote_request_id `{r}` is not this pair's request `{request_id}`"
                ));
            }
            Some(_) => {}
        }
        let host = p
            .get("remote_host")
            .and_then(Value::as_str)
            .filter(|h| !h.is_empty())
            .ok_or("kv_transfer_params.remote_host missing")?;
        // vLLM's side-channel host defaults to "localhost" (`VLLM_NIXL_SIDE_CHANNEL_HOST`,
        // `vllm/envs.py`): a prefill on another machine that kept the default would send the
        // decode to its own machine, where another engine's blocks may sit.
        if is_loopback(host) && !is_loopback(prefill_host) {
            return Err(format!(
                "kv_transfer_params.remote_host is `{host}`, but the prefill worker is at `{prefill_host}`: set VLLM_NIXL_SIDE_CHANNEL_HOST on the prefill to an address its decodes can reach"
            ));
        }
        if !p
            .get("remote_port")
            .and_then(Value::as_u64)
            .is_some_and(|port| (1..=65535).contains(&port))
        {
            return Err("kv_transfer_params.remote_port missing or out of range".into());
        }
    }
    Ok(())
}

/// `localhost`, `127.0.0.0/8` or `::1` (brackets allowed).
fn is_loopback(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h.eq_ignore_ascii_case("localhost")
        || h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    use serde_json::json;

    struct Checker(VllmSection);

    fn backend(connector: VllmConnector) -> Checker {
        Checker(VllmSection {
            connector,
            block_size: 16,
            served_model_name: None,
            kv_lease_ms: 30_000,
        })
    }

    fn params(ids: Value) -> Value {
        json!({ "do_remote_prefill": true, "remote_block_ids": ids, "remote_engine_id": "e",
                "remote_request_id": "cmpl-77-0-1a2b3c4d", "remote_host": "10.0.0.1", "remote_port": 5600 })
    }

    impl Checker {
        /// `check_params` for pair 77's request.
        fn check_params_t(&self, p: Option<&Value>, prompt_tokens: u64) -> Result<(), String> {
            check_params(&self.0, p, prompt_tokens, "77", "10.0.0.1")
        }
    }

    #[test]
    fn transfer_params_are_checked_before_any_decode() {
        let b = backend(VllmConnector::Nixl);
        // 40 tokens at block size 16: 2 full blocks, 3 in all; both counts are consistent.
        // vLLM 0.33: one list per KV-cache group.
        assert!(b.check_params_t(Some(&params(json!([[4, 9]]))), 40).is_ok());
        assert!(
            b.check_params_t(Some(&params(json!([[4, 9, 2]]))), 40)
                .is_ok()
        );
        // A full-attention group and a sliding-window group (fewer blocks); ids repeat across
        // groups (unique per group only).
        assert!(
            b.check_params_t(Some(&params(json!([[4, 9, 2], [4]]))), 40)
                .is_ok()
        );
        // remote_num_tokens within one block below the prompt (MTP/mamba backoff).
        let mut p = params(json!([[4, 9]]));
        p["remote_num_tokens"] = json!(32);
        assert!(b.check_params_t(Some(&p), 40).is_ok());
        // Before 0.33: one flat list.
        assert!(b.check_params_t(Some(&params(json!([4, 9]))), 40).is_ok());
        assert!(
            b.check_params_t(Some(&params(json!([4, 9, 2]))), 40)
                .is_ok()
        );
        let mut far = params(json!([[4]]));
        far["remote_num_tokens"] = json!(16);
        let mut over = params(json!([[4, 9, 2]]));
        over["remote_num_tokens"] = json!(41);
        for (bad, why) in [
            (params(json!([4])), "covers"),
            (params(json!([[4]])), "covers"),
            (params(json!([4, 9, 2, 7])), "at most"),
            (params(json!([[4, 9, 2], [1, 2, 3, 5]])), "at most"),
            (params(json!([4, 4, 2])), "twice"),
            (params(json!([[4, 4, 2]])), "twice"),
            (params(json!([4, "9", 2])), "non-integer"),
            (params(json!([[4, "9", 2]])), "non-integer"),
            (params(json!([[4, 9], 2])), "non-integer"),
            (params(json!(null)), "remote_block_ids"),
            (far, "remote_num_tokens"),
            (over, "remote_num_tokens"),
            (
                json!({ "remote_block_ids": [1, 2], "remote_host": "h", "remote_port": 1 }),
                "engine_id",
            ),
            (
                json!({ "remote_block_ids": [1, 2], "remote_engine_id": "e", "remote_request_id": "cmpl-77-0-1", "remote_port": 1 }),
                "remote_host",
            ),
            (
                json!({ "remote_block_ids": [1, 2], "remote_engine_id": "e", "remote_host": "h", "remote_port": 1 }),
                "remote_request_id missing",
            ),
            (
                json!({ "remote_block_ids": [1, 2], "remote_engine_id": "e", "remote_request_id": "cmpl-778-0-1", "remote_host": "h", "remote_port": 1 }),
                "not this pair's",
            ),
            (
                json!({ "remote_block_ids": [1, 2], "remote_engine_id": "e", "remote_request_id": "cmpl-77-0-1", "remote_host": "h", "remote_port": 70000 }),
                "remote_port",
            ),
            (json!("not an object"), "no kv_transfer_params"),
            (
                json!({ "remote_block_ids": [1, 2], "remote_engine_id": "e", "remote_request_id": "cmpl-77-0-1", "remote_host": "localhost", "remote_port": 5600 }),
                "VLLM_NIXL_SIDE_CHANNEL_HOST",
            ),
            (
                json!({ "remote_block_ids": [1, 2], "remote_engine_id": "e", "remote_request_id": "cmpl-77-0-1", "remote_host": "127.0.0.1", "remote_port": 5600 }),
                "VLLM_NIXL_SIDE_CHANNEL_HOST",
            ),
        ] {
            let e = b.check_params_t(Some(&bad), 40).expect_err(why);
            assert!(e.contains(why), "{why}: {e}");
        }
        assert!(b.check_params_t(None, 40).is_err());
        // A loopback side channel is fine when the prefill itself is on loopback.
        let local = json!({ "remote_block_ids": [1, 2], "remote_engine_id": "e", "remote_request_id": "cmpl-77-0-1", "remote_host": "localhost", "remote_port": 5600 });
        assert!(check_params(&b.0, Some(&local), 40, "77", "127.0.0.1").is_ok());
        assert!(check_params(&b.0, Some(&local), 40, "77", "[::1]").is_ok());
        // Mooncake's params need no host and port.
        let m = backend(VllmConnector::Mooncake);
        let p = json!({ "remote_block_ids": [1, 2], "remote_engine_id": "e" });
        assert!(m.check_params_t(Some(&p), 40).is_ok());
        assert!(b.check_params_t(Some(&p), 40).is_err());
    }
}
