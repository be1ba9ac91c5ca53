//! Embeddings: on the embedded node when it serves the model, else on the least loaded
//! healthy remote node that does; metered either way.

use axum::http::HeaderMap;

use super::{Inference, ValidEmbedRequest};
use crate::envelope::ApiError;
use crate::limits::Task;
use crate::nodes::Attempt;
use crate::store::ModelRecord;

/// An embedding answer: vectors, input tokens, and how long the node took (queue and
/// compute; reported as `Server-Timing: node;dur=...`, so a client can tell the control
/// plane's own time from the model's).
pub struct Embedded {
    pub data: Vec<Vec<f32>>,
    pub tokens: usize,
    pub node_time: std::time::Duration,
    /// The `x-ratelimit-*` headers for the response.
    pub limit_headers: HeaderMap,
}

impl Embedded {
    /// The headers of this answer: the rate limit's and `Server-Timing`.
    pub fn headers(&self) -> HeaderMap {
        let mut h = self.limit_headers.clone();
        h.insert(
            axum::http::HeaderName::from_static("server-timing"),
            bulkhead_runtime::server::server_timing("node", self.node_time),
        );
        h
    }

    /// Values per vector (0 for none).
    pub fn dims(&self) -> usize {
        self.data.first().map_or(0, Vec::len)
    }
}

/// An embedding as a JSON array of its values written as f32s: the shortest decimal that
/// reads back as the same f32 (`0.08817223`, not the f64 widening `0.08817222714424133`).
/// Answers are about half the size, and clients (a worker's JS too, which parses them and
/// often prints them again) convert half the digits.
pub fn embedding_json(v: &[f32]) -> serde_json::Value {
    serde_json::Value::Array(
        v.iter()
            .map(|&x| {
                // Rust prints a float as the shortest decimal that reads back as it.
                let short: f64 = x.to_string().parse().unwrap_or(f64::NAN);
                serde_json::Number::from_f64(short).map_or(serde_json::Value::Null, Into::into)
            })
            .collect(),
    )
}

impl Inference {
    /// Embed a validated request's texts with `model` as `tenant`, after the rate limit.
    pub async fn embed(
        &self,
        tenant: &str,
        model: &ModelRecord,
        req: ValidEmbedRequest,
    ) -> Result<Embedded, ApiError> {
        let limit_headers = self.rate_limit(tenant, Task::Embeddings).await?;
        let texts = req.into_texts();
        let started = std::time::Instant::now();
        let result = if self.node.embed.contains_key(&model.name) {
            self.node
                .embed(&model.name, texts)
                .await
                .map_err(ApiError::from)
        } else {
            self.embed_remote(tenant, model, texts).await
        };
        let node_time = started.elapsed();
        match result {
            Ok((data, tokens)) => {
                // Durable before the answer goes out (or the answer is an error).
                self.meter(tenant, &model.name, tokens as i64, 0).await?;
                Ok(Embedded {
                    data,
                    tokens,
                    node_time,
                    limit_headers,
                })
            }
            Err(e) => Err(self.meter_failure(tenant, &model.name, 0, e).await),
        }
    }

    /// Embed on the least loaded healthy remote node serving `model`, trying the next when
    /// one never took the request.
    async fn embed_remote(
        &self,
        tenant: &str,
        model: &ModelRecord,
        texts: Vec<String>,
    ) -> Result<(Vec<Vec<f32>>, usize), ApiError> {
        let nodes = self.nodes.serving(&model.name);
        if nodes.is_empty() {
            return Err(ApiError::unavailable(format!(
                "no node serves {}",
                model.name
            )));
        }
        let mut last = None;
        for node in nodes {
            let answer =
                crate::nodes::embed(self.nodes.http(), &node, &model.name, tenant, texts.clone())
                    .await;
            match answer {
                Ok(r) => return Ok((r.data, r.usage.prompt_tokens)),
                Err(Attempt::NotAdmitted(e)) => last = Some(e),
                Err(Attempt::Failed(e)) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| ApiError::unavailable("no node available")))
    }
}

#[cfg(test)]
mod tests {
    use super::embedding_json;

    #[test]
    fn embeddings_are_written_as_f32s_and_read_back_exactly() {
        let v = [
            0.088_172_23_f32,
            -0.017_421_5,
            1.0,
            0.0,
            1e-8,
            -3.402_823_5e38,
        ];
        let text = embedding_json(&v).to_string();
        let back: Vec<f32> = serde_json::from_str(&text).unwrap();
        assert_eq!(back, v);
        assert!(text.contains("0.08817223"), "{text}");
        assert!(
            !text.contains("0.0881722271"),
            "written as the f64 widening: {text}"
        );
        assert_eq!(embedding_json(&[f32::NAN]).to_string(), "[null]");
    }
}
