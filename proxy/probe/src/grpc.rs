//! The probe over lockstep's gRPC API (`lockstep.v1.Lockstep`): `Chat` and `Generate`, always
//! streamed, read to the end or left after the first delta; models from `ListModels`.

use std::time::{Duration, Instant};

use lockstep_proto::v1 as pb;
use lockstep_proto::v1::lockstep_client::LockstepClient;
use tonic::transport::Channel;

use crate::http::{Answer, Discovery, REQUEST_TIMEOUT};
use crate::plan::{Api, Job, Shape};
use crate::stats::Outcome;

/// A gRPC target.
#[derive(Clone, Debug)]
pub struct GrpcTarget {
    client: LockstepClient<Channel>,
}

fn request<T>(msg: T, key: Option<&str>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(REQUEST_TIMEOUT);
    if let Some(k) = key
        && let Ok(v) = format!("Bearer {k}").parse()
    {
        r.metadata_mut().insert("authorization", v);
    }
    r
}

/// Whether a status came from the server (not from failing to reach it).
fn from_server(s: &tonic::Status) -> bool {
    // A transport failure carries its cause as the source; a server's status has none.
    let transport = matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Unknown)
        && std::error::Error::source(s).is_some();
    !transport
}

fn kind(s: &tonic::Status) -> &'static str {
    use tonic::Code as C;
    match s.code() {
        C::DeadlineExceeded | C::Cancelled => "timeout",
        C::InvalidArgument
        | C::NotFound
        | C::PermissionDenied
        | C::Unauthenticated
        | C::ResourceExhausted
        | C::FailedPrecondition
        | C::OutOfRange
        | C::AlreadyExists
        | C::Unimplemented => "grpc_refused",
        _ => "grpc_failed",
    }
}

impl GrpcTarget {
    /// A lazily connected client for `url` (`http://host:port`, h2c).
    pub fn new(url: &str) -> Result<GrpcTarget, String> {
        let ch = tonic::transport::Endpoint::from_shared(url.to_string())
            .map_err(|e| format!("--target {url}: {e}"))?
            .connect_timeout(Duration::from_secs(5))
            .connect_lazy();
        Ok(GrpcTarget {
            client: LockstepClient::new(ch),
        })
    }

    /// `ListModels`.
    pub async fn discover(&self, key: Option<&str>) -> Discovery {
        let mut d = Discovery::default();
        match self
            .client
            .clone()
            .list_models(request(pb::ListModelsRequest {}, key))
            .await
        {
            Ok(r) => {
                d.responded = true;
                for m in r.into_inner().models {
                    if d.first.is_none() {
                        d.first = Some(m.name.clone());
                    }
                    d.max_model_len.push((m.name, m.context_window));
                }
            }
            Err(s) => d.responded = from_server(&s),
        }
        d
    }

    /// Sends one job (Chat or Generate) and reads its stream.
    pub async fn run(&self, job: &Job, model: &str, key: Option<&str>) -> Answer {
        let t0 = Instant::now();
        let sampling = Some(pb::SamplingParams {
            max_tokens: Some(16),
            ..Default::default()
        });
        let mut c = self.client.clone();
        let started = match job.api {
            Api::Chat => {
                c.chat(request(
                    pb::ChatRequest {
                        model: model.to_string(),
                        messages: vec![pb::ChatMessage {
                            role: "user".into(),
                            content: job.prompt.clone(),
                        }],
                        sampling,
                    },
                    key,
                ))
                .await
            }
            _ => {
                c.generate(request(
                    pb::GenerateRequest {
                        model: model.to_string(),
                        prompt: Some(pb::generate_request::Prompt::Text(job.prompt.clone())),
                        sampling,
                    },
                    key,
                ))
                .await
            }
        };
        let mut a = Answer::unanswered();
        let mut stream = match started {
            Ok(s) => s.into_inner(),
            Err(s) => {
                a.responded = from_server(&s);
                if a.responded {
                    a.outcome = Outcome::Error(kind(&s));
                    a.raw = s.message().to_string();
                }
                a.latency = t0.elapsed();
                return a;
            }
        };
        a.responded = true;
        let mut committed = false;
        let end = loop {
            match stream.message().await {
                Ok(Some(ev)) => match ev.event {
                    Some(pb::generate_response::Event::Started(_)) => committed = true,
                    Some(pb::generate_response::Event::Delta(d)) => {
                        a.text.push_str(&d.text);
                        if job.shape == Shape::Leave && !d.text.is_empty() {
                            break Outcome::Left;
                        }
                    }
                    Some(pb::generate_response::Event::Finished(f)) => {
                        let normal = matches!(
                            pb::FinishReason::try_from(f.finish_reason),
                            Ok(pb::FinishReason::Stop | pb::FinishReason::Length)
                        );
                        break if normal {
                            Outcome::Completed
                        } else {
                            Outcome::Error("malformed")
                        };
                    }
                    None => {}
                },
                Ok(None) => break Outcome::Error("truncated"),
                Err(s) => {
                    a.raw = s.message().to_string();
                    break if committed && kind(&s) != "timeout" {
                        Outcome::Error("error_after_commit")
                    } else {
                        Outcome::Error(kind(&s))
                    };
                }
            }
        };
        a.outcome = end;
        a.latency = t0.elapsed();
        a
    }
}
