//! The tenant-scoped prefix cache on the real SmolLM2 135M: a tenant's second request with
//! the same long beginning reuses its whole pages and answers exactly as an uncached run
//! (greedy); another tenant, or the same tenant with another cache salt, reuses nothing; and
//! another tenant's time to first token cannot tell a prompt someone sent from one nobody
//! sent, while the tenant who sent it sees the hit.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_runtime::chat::ChatMessage;
use bulkhead_runtime::engine::{
    FinishReason, GenEvent, GenerateRequest, PrefixCaching, PromptInput, Usage,
};
use bulkhead_runtime::node::{Node, NodeConfig, SMOLLM2_NAME, TextModelConfig};
use bulkhead_runtime::sampling::SamplingParams;

const PAGE: usize = 16;

fn node() -> Arc<Node> {
    let cfg = NodeConfig {
        models_dir: Some(common::models_dir()),
        text_models: vec![TextModelConfig {
            name: SMOLLM2_NAME.into(),
            path: None,
            package: None,
            weights: Default::default(),
            context_window: Some(1024),
            system_prompt: None,
        }],
        embedding_models: vec![],
        page_size: PAGE,
        ..NodeConfig::default()
    };
    Arc::new(Node::start(&cfg).unwrap())
}

fn chat(system: &str, user: &str) -> PromptInput {
    PromptInput::Messages(vec![
        ChatMessage::new("system", system.into()),
        ChatMessage::new("user", user.into()),
    ])
}

struct Answer {
    text: String,
    usage: Usage,
    finish: FinishReason,
    /// From submission to the first token.
    ttft: Duration,
}

fn run(
    node: &Node,
    tenant: &str,
    input: PromptInput,
    cache: PrefixCaching,
    max_tokens: usize,
) -> Answer {
    let engine = &node.text_engine(SMOLLM2_NAME).unwrap();
    let start = Instant::now();
    let mut sub = engine
        .submit(GenerateRequest {
            tenant: tenant.into(),
            input,
            params: SamplingParams {
                temperature: 0.0,
                max_tokens,
                ..SamplingParams::default()
            },
            prefix_cache: cache,
        })
        .expect("admitted");
    let mut text = String::new();
    let mut ttft = None;
    while let Some(ev) = sub.events.blocking_recv() {
        match ev {
            GenEvent::Token { text: t } => {
                ttft.get_or_insert_with(|| start.elapsed());
                text.push_str(&t);
            }
            GenEvent::Done {
                usage,
                finish_reason,
            } => {
                return Answer {
                    ttft: ttft.unwrap_or_else(|| start.elapsed()),
                    text,
                    usage,
                    finish: finish_reason,
                };
            }
            GenEvent::Error(e) => panic!("generation failed: {e}"),
            _ => {}
        }
    }
    panic!("stream ended without Done")
}

/// Tokens two prompts share from their start.
fn shared_tokens(node: &Node, a: &PromptInput, b: &PromptInput) -> usize {
    let engine = &node.text_engine(SMOLLM2_NAME).unwrap();
    let (a, b) = (
        engine.tokenize_prompt(a, None).unwrap(),
        engine.tokenize_prompt(b, None).unwrap(),
    );
    a.iter().zip(&b).take_while(|(x, y)| x == y).count()
}

const SYSTEM: &str = "You are the help desk of the Lighthouse Museum. The museum opens at nine \
    in the morning and closes at five in the afternoon, every day except Monday. Tickets cost \
    twelve euros for adults and six for children; under-fives enter free. The lighthouse tower \
    has 212 steps and its gallery gives a view over the whole bay. Guided tours leave from the \
    keeper's cottage at ten, twelve and three. The cafe serves soup, sandwiches and cake. Dogs \
    on a lead are welcome in the gardens but not in the tower. Answer visitors briefly.";

#[test]
fn a_tenant_reuses_its_prefix_and_answers_as_if_uncached() {
    let node = node();
    let first = chat(SYSTEM, "When do you open?");
    let second = chat(SYSTEM, "How much is a ticket for a child?");
    let shared = shared_tokens(&node, &first, &second);
    assert!(shared > 4 * PAGE, "a long shared prefix ({shared} tokens)");

    let a1 = run(&node, "a", first.clone(), PrefixCaching::On, 16);
    assert_eq!(a1.usage.cached_tokens, 0, "nothing cached yet");
    let a2 = run(&node, "a", second.clone(), PrefixCaching::On, 24);
    // Whole pages shared, then the shared beginning of the next page copied, as far as the
    // first prompt's published (full) pages reach.
    let published = a1.usage.prompt_tokens / PAGE * PAGE;
    assert_eq!(
        a2.usage.cached_tokens,
        shared.min(published),
        "the shared prefix"
    );
    let uncached = run(&node, "a", second.clone(), PrefixCaching::Off, 24);
    assert_eq!(uncached.usage.cached_tokens, 0);
    assert_eq!(a2.text, uncached.text, "greedy: the same answer");
    assert_eq!(a2.finish, uncached.finish);
    assert_eq!(a2.usage.prompt_tokens, uncached.usage.prompt_tokens);

    // Another tenant, the same prompt: nothing of a's.
    let b = run(&node, "b", second.clone(), PrefixCaching::On, 24);
    assert_eq!(b.usage.cached_tokens, 0);
    assert_eq!(b.text, uncached.text);
    // A salt splits a's cache: a salted request starts cold, then reuses its own salt's pages.
    let salted = |s: &str| {
        run(
            &node,
            "a",
            second.clone(),
            PrefixCaching::Salted(s.into()),
            8,
        )
    };
    assert_eq!(salted("s1").usage.cached_tokens, 0);
    assert!(salted("s1").usage.cached_tokens > 0);
    assert_eq!(salted("s2").usage.cached_tokens, 0);
    // The identical prompt again: its published (full) pages, never its last token, whose
    // logits give the answer.
    let again = run(&node, "a", second.clone(), PrefixCaching::On, 24);
    let len = a2.usage.prompt_tokens;
    assert_eq!(again.usage.cached_tokens, (len / PAGE * PAGE).min(len - 1));
    assert_eq!(again.text, uncached.text);

    let pool = node.text_engine(SMOLLM2_NAME).unwrap().pool().stats();
    assert_eq!(pool.isolation_violations, 0);
    assert_eq!(pool.pages_free, pool.pages_total, "no page left held");
    assert!(pool.pages_cached > 0 && pool.cache_hits > 0);
}

/// Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs.
fn ks_statistic(a: &[f64], b: &[f64]) -> f64 {
    let (mut a, mut b) = (a.to_vec(), b.to_vec());
    a.sort_by(f64::total_cmp);
    b.sort_by(f64::total_cmp);
    let (mut i, mut j, mut d) = (0, 0, 0.0f64);
    while i < a.len() && j < b.len() {
        let x = a[i].min(b[j]);
        while i < a.len() && a[i] <= x {
            i += 1;
        }
        while j < b.len() && b[j] <= x {
            j += 1;
        }
        d = d.max((i as f64 / a.len() as f64 - j as f64 / b.len() as f64).abs());
    }
    d
}

/// Critical value of the two-sample KS statistic at significance `alpha` (asymptotic).
fn ks_critical(n: usize, m: usize, alpha: f64) -> f64 {
    let c = (-(alpha / 2.0).ln() / 2.0).sqrt();
    c * (((n + m) as f64) / ((n * m) as f64)).sqrt()
}

/// A prompt of `words` words drawn by `seed`, as a raw prompt.
fn document(seed: u64, words: usize) -> String {
    const WORDS: &[&str] = &[
        "harbor", "lantern", "granite", "orchard", "meadow", "copper", "violet", "thunder",
        "ribbon", "falcon", "pepper", "saddle", "marble", "candle", "willow", "basket", "silver",
        "gravel", "cedar", "pillow", "hammer", "velvet", "anchor", "island",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = format!("Document {seed}:");
    for _ in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push(' ');
        out.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
    }
    out
}

/// The timing side channel of a shared cache (NDSS 2025): tenant b probes prompts tenant a
/// just sent and prompts nobody sent, interleaved; with namespaces per tenant the two TTFT
/// samples come from one distribution (KS does not reject at 1%), and every probe reports 0
/// cached tokens. The same probes as tenant a hit, and are clearly faster.
#[test]
fn another_tenant_cannot_time_whether_a_prompt_was_sent() {
    const PROBES: usize = 50;
    const WORDS: usize = 160;
    let node = node();
    let engine = node.text_engine(SMOLLM2_NAME).unwrap().clone();
    let tokens = |p: &str| {
        engine
            .tokenize_prompt(
                &PromptInput::Text {
                    prompt: p.into(),
                    raw: true,
                },
                None,
            )
            .unwrap()
            .len()
    };
    let raw = |p: &str| PromptInput::Text {
        prompt: p.into(),
        raw: true,
    };
    // Warm up the engine (first-use allocations) outside the samples.
    run(
        &node,
        "warm",
        raw(&document(u64::MAX, WORDS)),
        PrefixCaching::On,
        1,
    );

    let (mut sent, mut unsent, mut owner) = (Vec::new(), Vec::new(), Vec::new());
    // Seeds of four digits on both sides, so the headers tokenize alike.
    let mut seed = 5_000u64;
    for i in 0..PROBES {
        let secret = document(1_000 + i as u64, WORDS);
        // A prompt nobody sent, of the same length in tokens.
        let fresh = loop {
            seed += 1;
            assert!(seed < 10_000, "no unsent prompt of the same length");
            let p = document(seed, WORDS);
            if tokens(&p) == tokens(&secret) {
                break p;
            }
        };
        let a = run(&node, "a", raw(&secret), PrefixCaching::On, 1);
        assert!(
            a.usage.cached_tokens < PAGE,
            "at most a header shared with a's earlier ones"
        );
        // Alternate which probe goes first, so drift cannot favour one sample.
        let probes = if i % 2 == 0 {
            [(&secret, true), (&fresh, false)]
        } else {
            [(&fresh, false), (&secret, true)]
        };
        for (j, (prompt, was_sent)) in probes.into_iter().enumerate() {
            // Each probe in a namespace of b's own with nothing in it (its own salt), so that
            // b's earlier probes (which share a header) give it nothing either: any cached
            // token could only be a's.
            let salt = PrefixCaching::Salted(format!("probe-{i}-{j}"));
            let b = run(&node, "b", raw(prompt), salt, 1);
            assert_eq!(b.usage.cached_tokens, 0, "b reuses nothing of a's");
            let t = b.ttft.as_secs_f64();
            if was_sent {
                sent.push(t)
            } else {
                unsent.push(t)
            }
        }
        let hit = run(&node, "a", raw(&secret), PrefixCaching::On, 1);
        assert!(hit.usage.cached_tokens > 0, "a reuses its own prompt");
        owner.push(hit.ttft.as_secs_f64());
    }
    let critical = ks_critical(PROBES, PROBES, 0.01);
    let across = ks_statistic(&sent, &unsent);
    let own = ks_statistic(&owner, &unsent);
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    eprintln!(
        "TTFT medians: b on a's prompts {:.1} ms, b on unsent {:.1} ms, a on its own {:.1} ms; \
         KS b-vs-b {across:.3}, a-vs-b {own:.3}, critical {critical:.3}",
        median(&sent) * 1e3,
        median(&unsent) * 1e3,
        median(&owner) * 1e3
    );
    assert!(
        across < critical,
        "b can tell a's prompts from unsent ones: KS {across:.3} >= {critical:.3}"
    );
    assert!(
        own >= critical && median(&owner) < median(&unsent),
        "a's own hits are not told apart: KS {own:.3}"
    );
    assert_eq!(engine.pool().stats().isolation_violations, 0);
}
