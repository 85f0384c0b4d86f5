//! Logs and traces. Logs go to stdout (`server.log_level`); with `telemetry.otlp_endpoint` set,
//! spans are exported over OTLP/gRPC (tonic, batched): one `request` span per HTTP request (the
//! client's W3C `traceparent` honoured as its parent), an `admission` span, and per pair a `pair`
//! span with `prefill`, `decode`, `kv_transfer` and `commit_barrier` children; abort reasons are
//! events on the pair span. The trace context goes to both halves' upstream requests
//! (`traceparent` header).

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use serde::Deserialize;

/// `[telemetry]`: OpenTelemetry trace export over OTLP/gRPC.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// The collector, e.g. `http://127.0.0.1:4317`. Empty: no export (the default).
    pub otlp_endpoint: String,
    /// Share of new traces recorded (0 to 1); a client's sampled `traceparent` is followed.
    pub sampling_ratio: f64,
    /// `service.name` of the exported spans.
    pub service_name: String,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: String::new(),
            sampling_ratio: 1.0,
            service_name: "lockstep".into(),
        }
    }
}

impl crate::toml_file::Section for TelemetryConfig {
    fn validate(&self, at: &str, out: &mut crate::toml_file::Problems) {
        if !(0.0..=1.0).contains(&self.sampling_ratio) {
            out.push(
                format!("{at}.sampling_ratio"),
                format!("{} is not between 0 and 1", self.sampling_ratio),
            );
        }
        if !self.otlp_endpoint.is_empty() && self.otlp_endpoint.parse::<http::Uri>().is_err() {
            out.push(
                format!("{at}.otlp_endpoint"),
                format!("`{}` is not a URL", self.otlp_endpoint),
            );
        }
    }
}

/// Logs only, to stdout, filtered by `level` (`info` when it does not parse): for the commands
/// that export no traces (`check`, `worker`) and for errors before the configuration is read.
pub fn init_logs(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .try_init();
}

/// The installed exporter (flush on demand, shut down on exit).
#[derive(Debug, Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Exports every finished span now.
    pub fn flush(&self) {
        if let Some(p) = &self.provider
            && let Err(e) = p.force_flush()
        {
            tracing::warn!(error = %e, "span export flush failed");
        }
    }

    /// Flushes and stops the exporter.
    pub fn shutdown(self) {
        if let Some(p) = self.provider {
            let _ = p.force_flush();
            let _ = p.shutdown();
        }
    }
}

/// Installs the process-wide subscriber: logs filtered by `log_level`, and span export when
/// `cfg.otlp_endpoint` is set. Call once, inside the tokio runtime (the gRPC exporter needs it).
pub fn init(log_level: &str, cfg: &TelemetryConfig) -> Result<Telemetry, String> {
    let filter = tracing_subscriber::EnvFilter::try_new(log_level)
        .map_err(|e| format!("server.log_level `{log_level}`: {e}"))?;
    let fmt = tracing_subscriber::fmt::layer();
    if cfg.otlp_endpoint.is_empty() {
        let _ = tracing_subscriber::registry()
            .with(filter)
            .with(fmt)
            .try_init();
        return Ok(Telemetry::default());
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(cfg.otlp_endpoint.clone())
        .build()
        .map_err(|e| format!("telemetry.otlp_endpoint `{}`: {e}", cfg.otlp_endpoint))?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            cfg.sampling_ratio,
        ))))
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(cfg.service_name.clone())
                .build(),
        )
        .build();
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("lockstep"));
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(layer)
        .try_init();
    Ok(Telemetry {
        provider: Some(provider),
    })
}

struct HeaderExtract<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtract<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

struct HeaderInject<'a>(&'a mut Vec<(http::HeaderName, http::HeaderValue)>);

impl Injector for HeaderInject<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.push((k, v));
        }
    }
}

/// Makes the client's `traceparent` (if any) the parent of `span`.
pub fn adopt_parent(span: &tracing::Span, headers: &http::HeaderMap) {
    let cx = TraceContextPropagator::new().extract(&HeaderExtract(headers));
    let _ = span.set_parent(cx);
}

/// The `traceparent`/`tracestate` headers of the current span, for an upstream request (empty
/// when no span is being recorded).
pub fn trace_headers() -> Vec<(http::HeaderName, http::HeaderValue)> {
    let cx = tracing::Span::current().context();
    let mut out = Vec::new();
    TraceContextPropagator::new().inject_context(&cx, &mut HeaderInject(&mut out));
    out
}
