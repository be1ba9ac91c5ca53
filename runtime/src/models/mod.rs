//! The models a node serves: decoder text generation (llama, Gemma 3) over the paged pool,
//! BERT sentence embeddings on the runtime's kernels (`encoder`; `bert` is candle's, the
//! tests' oracle), the GGUF tokenizers and chat templates, and the model cache.

pub mod bert;
pub mod decoder;
pub mod encoder;
pub mod fetch;
pub mod tokenizer;
