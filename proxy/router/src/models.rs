//! Building the served models from a configuration: for each model its deployment check against
//! what the workers report, tokenizer and chat template, worker pools, backend and health checks;
//! and reloading them (validate, build, swap atomically).

use std::sync::Arc;

use lockstep_engine::engine::ModelBundle;
use lockstep_engine::pd::Pd;
use lockstep_runtime::engine_section::EngineMode;

use crate::backend::embedded::EmbeddedBackend;
use crate::backend::sglang::SglangBackend;
use crate::backend::{Deployment, PdBackend, UpstreamClient};
use crate::pair::{ModelPairs, PairRegistry, PairStats};
use crate::state::{AppState, ModelRuntime, Models, WorkerLimits};
use lockstep_core::audit::Audit;
use lockstep_core::config::{BackendKind, Config, ModelConfig, PoolConfig, WorkerConfig};
use lockstep_core::metrics::Metrics;
use lockstep_prompt::PromptCodec;
use lockstep_routing::pool::{MemberFeed, WorkerPool};

/// The deployment check of `m` against its live workers, through its backend's probe
/// ([`PdBackend::deployment`]); an embedded model is checked against its configured pool.
/// Returns the limits admission will use, or every problem found.
pub async fn check_deployment(
    client: &UpstreamClient,
    m: &ModelConfig,
) -> Result<Deployment, String> {
    match remote_backend(m, client) {
        // An embeddings model has no pair to check: each answer is checked instead.
        Some(_) if m.embeds_remotely() => Ok(Deployment::capacity(m.configured_capacity())),
        Some(backend) => backend.deployment(m).await,
        None => crate::backend::embedded::pool_capacity(m).map(Deployment::capacity),
    }
}

/// `m` with each discovered pool's current workers in place of its discovery (what `lockstep
/// check` checks), and a line per pool saying what discovery found.
pub async fn with_discovered(m: &ModelConfig) -> Result<(ModelConfig, Vec<String>), String> {
    let mut m = m.clone();
    let mut found = Vec::new();
    for (side, pool) in [("prefill", &mut m.prefill), ("decode", &mut m.decode)] {
        let Some(d) = pool.discovery.take() else {
            continue;
        };
        let at = format!("model `{}`: {side} pool", m.name);
        let (_, workers, not_ready) = lockstep_routing::discovery::connect_and_list(&d)
            .await
            .map_err(|e| format!("{at}: {e}"))?;
        let urls: Vec<&str> = workers.iter().map(|w| w.url.as_str()).collect();
        found.push(format!(
            "{at}: discovery (namespace `{}`, selector `{}`) finds {} ready pod(s){}{}",
            d.namespace,
            d.selector,
            workers.len(),
            if urls.is_empty() {
                String::new()
            } else {
                format!(": {}", urls.join(", "))
            },
            if not_ready > 0 {
                format!("; {not_ready} not ready")
            } else {
                String::new()
            },
        ));
        pool.workers = workers;
    }
    Ok((m, found))
}

/// The backend of a model served by remote workers (`None` for the embedded engine).
pub fn remote_backend(m: &ModelConfig, client: &UpstreamClient) -> Option<Arc<dyn PdBackend>> {
    Some(match m.backend {
        BackendKind::Sglang => Arc::new(SglangBackend::new(client.clone())),
        BackendKind::Vllm => Arc::new(crate::backend::vllm::VllmBackend::new(
            client.clone(),
            &m.name,
            m.vllm.clone(),
        )),
        BackendKind::Lockstep => Arc::new(crate::backend::lockstep::LockstepBackend::new(
            client.connect_timeout(),
            client.plane().cloned(),
            &m.timeouts,
        )),
        BackendKind::Embedded => return None,
    })
}

/// Reloads the models and tenants of `st` from `cfg`: validate, deployment check against the
/// workers, build, then swap atomically (SIGHUP and the admin API). On any problem the running
/// configuration stays and the reasons are returned. Pairs in flight finish on the configuration
/// they started with; workers an operator drains stay drained.
pub async fn reload_state(st: &AppState, cfg: Config) -> Result<(), String> {
    // One reload at a time (SIGHUP and the admin API may race): each builds against, and
    // replaces, the generation the previous one stored.
    let _one = st.reload_lock.lock().await;
    let previous = st.models.load_full();
    let mut models = build_models(
        &cfg,
        &st.client,
        &st.registry,
        &st.stats,
        &st.metrics,
        &st.audit,
        Some(&previous),
    )
    .await?;
    for m in models.by_name.values() {
        for w in m
            .pairs
            .prefill
            .workers()
            .iter()
            .chain(m.pairs.decode.workers().iter())
        {
            w.set_draining(st.drained.contains(&w.url));
        }
    }
    let names: Vec<_> = models.by_name.keys().cloned().collect();
    models.tenants = Arc::new(previous.tenants.reloaded(&cfg.tenants));
    if previous.tenants.shared_config() != cfg.shared.as_ref() {
        tracing::warn!(
            "[shared] changed: it takes effect at the next restart; the store in use stays"
        );
    }
    // Models and tenants in one store.
    st.models.store(Arc::new(models));
    tracing::info!(models = ?names, "configuration reloaded");
    Ok(())
}

/// Builds every model of `cfg`: deployment check against the workers, tokenizer and template,
/// pools, backend, health checks. Lists every problem rather than build a partial set.
pub(crate) async fn build_models(
    cfg: &Config,
    client: &UpstreamClient,
    registry: &Arc<PairRegistry>,
    stats: &Arc<PairStats>,
    metrics: &Arc<Metrics>,
    audit: &Arc<Audit>,
    previous: Option<&Models>,
) -> Result<Models, String> {
    let problems = cfg.problems();
    if !problems.is_empty() {
        return Err(lockstep_core::config::lines(&problems).join("\n"));
    }
    // The worker plane's certificates are read again at every build (start and reload).
    let client = &client.with_plane(&cfg.worker_plane)?;
    let mut models = Models::default();
    let mut errors = Vec::new();
    for m in &cfg.models {
        let built = match m.backend {
            BackendKind::Embedded => build_embedded(m).await,
            _ => build_remote(m, client, metrics).await,
        };
        let Built {
            deployment,
            codec,
            backend,
            mut prefill,
            mut decode,
            engine,
            discovered,
        } = match built {
            Ok(b) => b,
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        if m.tool_mode() != lockstep_core::config::ToolParserKind::Generic
            && let Err(e) = codec.check_renders_tools()
        {
            errors.push(format!("model `{}`: {e}", m.name));
            continue;
        }
        if let Some(old) = previous.and_then(|p| p.by_name.get(&m.name)) {
            for (new, old) in [
                (&mut prefill, &old.pairs.prefill),
                (&mut decode, &old.pairs.decode),
            ] {
                if let Some(new) = Arc::get_mut(new) {
                    new.carry_from(old);
                }
                // Workers that joined at run time stay members, checked again with the new
                // set before they take pairs.
                if engine.is_none() {
                    new.carry_joined(old);
                }
            }
        }
        let limits = Arc::new(WorkerLimits::new(&deployment));
        let mut feed = None;
        if engine.is_none() {
            for w in prefill.workers().iter().chain(decode.workers().iter()) {
                if deployment.unverified.iter().any(|(url, _)| *url == w.url) {
                    w.set_verified(false);
                }
            }
            let (tx, source) = MemberFeed::new();
            feed = Some(tx);
            let members = Arc::new(crate::members::Members {
                model: m.clone(),
                backend: backend.clone(),
                client: client.clone(),
                limits: limits.clone(),
                prefill: prefill.clone(),
                decode: decode.clone(),
                verified: std::sync::Mutex::new(deployment.verified.clone()),
                probing: tokio::sync::Semaphore::new(crate::members::CONCURRENT_PROBES),
            });
            let mut sources = vec![source];
            sources.extend(discovered);
            let source = Box::pin(futures_util::stream::select_all(sources));
            models.health.push(tokio::spawn(members.run(source)));
        }
        let name: Arc<str> = m.name.as_str().into();
        let pairs = Arc::new(ModelPairs {
            model: name.clone(),
            backend,
            prefill,
            decode,
            registry: registry.clone(),
            timeouts: m.timeouts.clone(),
            retry: m.retry.clone(),
            failover: m.failover.clone(),
            detok: codec.concat_decoder(),
            stats: stats.clone(),
            metrics: metrics.clone(),
            audit: audit.clone(),
            series: lockstep_core::metrics::ModelMetrics::new(metrics, &name),
            queue: crate::pair::FairQueue::default(),
            queue_cfg: m.queue.clone(),
        });
        let capacity = deployment.kv_capacity;
        tracing::info!(model = %name, context_window = m.context_window, kv_capacity = capacity, worker_prompt_limit = ?deployment.max_prompt_tokens, "model ready");
        models.by_name.insert(
            m.name.clone(),
            Arc::new(ModelRuntime {
                name,
                cfg: m.clone(),
                codec,
                pairs,
                engine,
                embed: m
                    .embeds_remotely()
                    .then(|| Arc::new(WorkerPool::new(&m.embed))),
                limits,
                members: feed,
            }),
        );
    }
    if errors.is_empty() {
        Ok(models)
    } else {
        Err(errors.join("\n"))
    }
}

/// What one model's backend needs, built.
struct Built {
    deployment: Deployment,
    codec: Arc<PromptCodec>,
    backend: Arc<dyn PdBackend>,
    prefill: Arc<WorkerPool>,
    decode: Arc<WorkerPool>,
    engine: Option<Arc<Pd>>,
    /// The membership changes of each discovered pool.
    discovered: Vec<lockstep_routing::pool::WorkerSource>,
}

/// A model served by remote workers (SGLang, vLLM, lockstep workers): the backend's deployment
/// probe, then the tokenizer and template.
async fn build_remote(
    m: &ModelConfig,
    client: &UpstreamClient,
    metrics: &Arc<Metrics>,
) -> Result<Built, String> {
    let backend = remote_backend(m, client).ok_or("not a remote backend")?;
    let discovered = discover(m, metrics).await?;
    // The serving backend itself runs the check: it keeps what the workers reported (SGLang's
    // stream mode, say). An embeddings model has no pair to check: each answer is checked.
    let deployment = if m.embeds_remotely() {
        Deployment::capacity(m.configured_capacity())
    } else {
        backend.deployment(m).await?
    };
    let codec = remote_codec(m).await?;
    Ok(Built {
        deployment,
        codec,
        backend,
        prefill: Arc::new(WorkerPool::new(&m.prefill)),
        decode: Arc::new(WorkerPool::new(&m.decode)),
        engine: None,
        discovered,
    })
}

/// The watches of `m`'s discovered pools. Each starts empty: its pods join as the watch lists
/// them, and are checked like any worker that joins. One list first shows lockstep may see the
/// pods (RBAC, the selector, the API server's address): otherwise the model does not serve.
async fn discover(
    m: &ModelConfig,
    metrics: &Arc<Metrics>,
) -> Result<Vec<lockstep_routing::pool::WorkerSource>, String> {
    use lockstep_core::ids::Side;
    let mut sources = Vec::new();
    for (side, pool) in [(Side::Prefill, &m.prefill), (Side::Decode, &m.decode)] {
        let Some(d) = &pool.discovery else { continue };
        let at = format!("model `{}`: {} pool", m.name, side.as_str());
        let (client, workers, not_ready) = lockstep_routing::discovery::connect_and_list(d)
            .await
            .map_err(|e| format!("{at}: {e}"))?;
        tracing::info!(model = %m.name, side = side.as_str(), namespace = %d.namespace, selector = %d.selector, workers = workers.len(), not_ready, "Kubernetes discovery: pods listed; they join as the watch sees them");
        sources.push(lockstep_routing::discovery::watch(
            client,
            m.name.as_str().into(),
            side,
            d.clone(),
            metrics.clone(),
        ));
    }
    Ok(sources)
}

/// The tokenizer and template of a remote model: from `tokenizer` and `chat_template`, or (for
/// lockstep workers) from the model file named in `[models.engine]`, read but not loaded.
async fn remote_codec(m: &ModelConfig) -> Result<Arc<PromptCodec>, String> {
    let Some(e) = &m.engine else {
        return PromptCodec::load(m);
    };
    let (e, name) = (e.clone(), m.name.clone());
    let content_specials = m.special_tokens_in_content;
    let template = lockstep_prompt::codec::configured_template(m)?;
    tokio::task::spawn_blocking(move || {
        let path = lockstep_runtime::model_file::ensure_model(e.model_file())
            .map_err(|err| format!("model `{name}`: {err}"))?;
        let g = lockstep_runtime::model_file::open_model(e.model_file(), &path)
            .map_err(|err| format!("model `{name}`: {err}"))?;
        let t = lockstep_engine::tokenizer::ModelTokenizer::from_gguf(&g)
            .map_err(|err| format!("model `{name}`: {}: {err}", path.display()))?;
        model_file_codec(&name, &t, content_specials, template)
    })
    .await
    .map_err(|err| format!("model `{}`: tokenizer load panicked: {err}", m.name))?
}

/// PromptCodec from a model file's own tokenizer and chat template (or the configured template,
/// which replaces it), so the router and the engine count and render alike.
fn model_file_codec(
    name: &str,
    t: &lockstep_engine::tokenizer::ModelTokenizer,
    special_tokens_in_content: bool,
    configured: Option<String>,
) -> Result<Arc<PromptCodec>, String> {
    let template = configured
        .or_else(|| t.chat_template.clone())
        .ok_or_else(|| format!("model `{name}`: the model file has no chat template"))?;
    PromptCodec::new_with(
        special_tokens_in_content,
        name,
        t.inner.clone(),
        template,
        t.decode(&[t.bos]),
        t.decode(&[t.eos]),
    )
}

/// An embedded model: fetch (if absent) and verify the file, load it, start the engines; the
/// router's tokenizer and chat template are the model file's own. Capacity is one pool's tokens.
async fn build_embedded(m: &ModelConfig) -> Result<Built, String> {
    let e = m
        .engine
        .clone()
        .ok_or_else(|| format!("model `{}`: no [models.engine] section", m.name))?;
    let name = m.name.clone();
    let content_specials = m.special_tokens_in_content;
    let template = lockstep_prompt::codec::configured_template(m)?;
    let (pd, codec) = tokio::task::spawn_blocking(move || {
        let path = lockstep_runtime::model_file::ensure_model(e.model_file()).map_err(|err| format!("model `{name}`: {err}"))?;
        let device = e
            .device()
            .map_err(|err| format!("model `{name}`: engine.{err}"))?;
        let device =
            ModelBundle::choose_device(device).map_err(|err| format!("model `{name}`: {err}"))?;
        let g = lockstep_runtime::model_file::open_model(e.model_file(), &path)
            .map_err(|err| format!("model `{name}`: {err}"))?;
        let bundle = Arc::new(
            ModelBundle::from_gguf(&g, device).map_err(|err| format!("model `{name}`: {err}"))?,
        );
        drop(g);
        tracing::info!(model = %name, device = %bundle.device(), "embedded engine device");
        let codec = model_file_codec(&name, &bundle.tokenizer, content_specials, template)?;
        let cfg = e.engine_config();
        let faults = e.fault_plan();
        if faults.is_some() {
            tracing::warn!(model = %name, fault = ?e.fault, "KV transfer FAULT INJECTION is on: unsafe, for tests only");
        }
        let pd = match e.mode {
            EngineMode::Split => Pd::split(bundle, cfg, cfg, faults),
            EngineMode::Unified => Pd::unified(bundle, cfg),
        }
        .map_err(|err| format!("model `{name}`: engine: {err}"))?;
        tracing::info!(model = %name, mode = ?e.mode, file = %path.display(), kv_pages = e.kv_pages, page_size = e.page_size, "embedded engine ready (cpu)");
        Ok::<_, String>((Arc::new(pd), codec))
    })
    .await
    .map_err(|err| format!("model `{}`: engine start panicked: {err}", m.name))??;
    let backend: Arc<dyn PdBackend> = Arc::new(EmbeddedBackend::new(pd.clone()));
    let deployment = backend.deployment(m).await?;
    let pool = |side: &str| {
        Arc::new(WorkerPool::new(&PoolConfig {
            policy: Default::default(),
            workers: vec![WorkerConfig {
                url: format!("embedded://{}/{side}", m.name),
                bootstrap_port: None,
                bootstrap_host: None,
                kv_events: None,
                kv_events_replay: None,
            }],
            ..PoolConfig::default()
        }))
    };
    Ok(Built {
        deployment,
        codec,
        backend,
        prefill: pool("prefill"),
        decode: pool("decode"),
        engine: Some(pd),
        discovered: Vec::new(),
    })
}
