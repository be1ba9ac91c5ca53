//! The models a node serves: llama text generation over the paged pool, BERT sentence
//! embeddings on the runtime's kernels (`encoder`; `bert` is candle's, the tests' oracle),
//! the GGUF tokenizer and chat template, and the model cache.

pub mod bert;
pub mod encoder;
pub mod fetch;
pub mod llama;
pub mod tokenizer;
