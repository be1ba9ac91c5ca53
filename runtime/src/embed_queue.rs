//! A node's embedding queue: one thread per embedding model forms batches from concurrent
//! requests and runs each batch as one packed forward.
//!
//! While a batch runs, requests wait; the next batch takes every request waiting then, up to
//! [`MAX_BATCH_TOKENS`] tokens (a single larger request runs alone). So no request waits for
//! more than the batch ahead of it, there is no timer to tune, and under load the texts of many
//! requests share each matmul's pass over the weights. A batch is packed (see
//! `kernels::encoder`), so mixing short and long texts pads nothing.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;

use tokio::sync::oneshot;

use crate::error::RuntimeError;
use crate::models::encoder::{Encoder, Scratch};

/// A batch stops taking further requests at this many tokens.
pub const MAX_BATCH_TOKENS: usize = 8192;

type Vectors = Vec<Vec<f32>>;

/// One request's admitted texts (token ids) and where its vectors go.
struct Job {
    seqs: Vec<Vec<u32>>,
    reply: oneshot::Sender<Result<Vectors, RuntimeError>>,
}

impl Job {
    fn tokens(&self) -> usize {
        self.seqs.iter().map(Vec::len).sum()
    }
}

/// Counters shared with the batching thread.
#[derive(Default)]
struct Counts {
    waiting: AtomicUsize,
    batches: AtomicU64,
}

pub struct EmbedQueue {
    encoder: Arc<Encoder>,
    jobs: mpsc::Sender<Job>,
    counts: Arc<Counts>,
}

impl EmbedQueue {
    /// Start the batching thread of `encoder` (it ends when the queue is dropped).
    pub fn start(encoder: Arc<Encoder>, model: &str) -> EmbedQueue {
        let (jobs, rx) = mpsc::channel();
        let counts = Arc::new(Counts::default());
        let (e, c) = (encoder.clone(), counts.clone());
        std::thread::Builder::new()
            .name(format!("embed {model}"))
            .spawn(move || run_batches(&e, &rx, &c))
            .expect("spawning an embedding thread");
        EmbedQueue {
            encoder,
            jobs,
            counts,
        }
    }

    pub fn encoder(&self) -> &Encoder {
        &self.encoder
    }

    /// Requests waiting for a batch or in the running one.
    pub fn queue_depth(&self) -> usize {
        self.counts.waiting.load(Ordering::Relaxed)
    }

    /// Batches run so far.
    pub fn batches(&self) -> u64 {
        self.counts.batches.load(Ordering::Relaxed)
    }

    /// Embed admitted token sequences (`Encoder::admit`) in the next batch.
    pub async fn embed(&self, seqs: Vec<Vec<u32>>) -> Result<Vectors, RuntimeError> {
        let (reply, rx) = oneshot::channel();
        self.counts.waiting.fetch_add(1, Ordering::Relaxed);
        if self.jobs.send(Job { seqs, reply }).is_err() {
            self.counts.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(RuntimeError::Internal(
                "the embedding thread has stopped".into(),
            ));
        }
        rx.await
            .map_err(|_| RuntimeError::Internal("the embedding thread has stopped".into()))?
    }
}

/// The next batch: `first` (or the next job to arrive) and every job already waiting, up to
/// [`MAX_BATCH_TOKENS`]; a job that would pass the limit is handed back in `carried` for the
/// batch after. `None` once the queue is gone.
fn next_batch(rx: &mpsc::Receiver<Job>, carried: &mut Option<Job>) -> Option<Vec<Job>> {
    let first = match carried.take() {
        Some(j) => j,
        None => rx.recv().ok()?,
    };
    let mut tokens = first.tokens();
    let mut batch = vec![first];
    while let Ok(j) = rx.try_recv() {
        if tokens + j.tokens() > MAX_BATCH_TOKENS {
            *carried = Some(j);
            break;
        }
        tokens += j.tokens();
        batch.push(j);
    }
    Some(batch)
}

fn run_batches(encoder: &Encoder, rx: &mpsc::Receiver<Job>, counts: &Counts) {
    let mut scratch = Scratch::default();
    let mut carried = None;
    while let Some(batch) = next_batch(rx, &mut carried) {
        let taken = batch.len();
        // A caller that went away (a dropped connection) costs nothing.
        let batch: Vec<Job> = batch.into_iter().filter(|j| !j.reply.is_closed()).collect();
        if !batch.is_empty() {
            let seqs: Vec<&[u32]> = batch
                .iter()
                .flat_map(|j| j.seqs.iter().map(Vec::as_slice))
                .collect();
            // On a rayon worker, so the matmuls' parallel loops start there instead of
            // handing off to the pool and sleeping once each.
            let out = std::panic::catch_unwind(AssertUnwindSafe(|| {
                rayon::scope(|_| encoder.embed_tokens(&seqs, &mut scratch))
            }));
            counts.batches.fetch_add(1, Ordering::Relaxed);
            match out {
                Ok(mut vectors) => {
                    for j in batch {
                        let rest = vectors.split_off(j.seqs.len());
                        let _ = j.reply.send(Ok(std::mem::replace(&mut vectors, rest)));
                    }
                }
                Err(_) => {
                    // The thread goes on with fresh buffers; the batch's requests get a 500.
                    scratch = Scratch::default();
                    for j in batch {
                        let _ = j.reply.send(Err(RuntimeError::Internal(
                            "the embedding batch failed".into(),
                        )));
                    }
                }
            }
        }
        counts.waiting.fetch_sub(taken, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(tokens: usize) -> (Job, oneshot::Receiver<Result<Vectors, RuntimeError>>) {
        let (reply, rx) = oneshot::channel();
        let seqs = vec![vec![101; tokens]];
        (Job { seqs, reply }, rx)
    }

    #[test]
    fn a_batch_takes_every_waiting_request_up_to_the_token_limit() {
        let (tx, rx) = mpsc::channel();
        let mut keep = Vec::new();
        for tokens in [10, 20, 30, MAX_BATCH_TOKENS - 50, 5] {
            let (j, r) = job(tokens);
            tx.send(j).unwrap();
            keep.push(r);
        }
        let mut carried = None;
        let sizes = |b: Vec<Job>| b.iter().map(Job::tokens).collect::<Vec<_>>();
        // 10 + 20 + 30 fit; the next would pass the limit and starts the next batch.
        let first = next_batch(&rx, &mut carried).unwrap();
        assert_eq!(sizes(first), [10, 20, 30]);
        assert_eq!(
            carried.as_ref().map(Job::tokens),
            Some(MAX_BATCH_TOKENS - 50)
        );
        let second = next_batch(&rx, &mut carried).unwrap();
        assert_eq!(sizes(second), [MAX_BATCH_TOKENS - 50, 5]);
        // A request larger than the limit runs alone.
        let (big, _r) = job(MAX_BATCH_TOKENS + 1);
        tx.send(big).unwrap();
        let (small, _r2) = job(3);
        tx.send(small).unwrap();
        assert_eq!(
            sizes(next_batch(&rx, &mut carried).unwrap()),
            [MAX_BATCH_TOKENS + 1]
        );
        assert_eq!(sizes(next_batch(&rx, &mut carried).unwrap()), [3]);
        drop(tx);
        assert!(next_batch(&rx, &mut carried).is_none());
    }
}
