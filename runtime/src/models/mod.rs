//! The models a node serves: llama text generation over the paged pool, BERT embeddings,
//! the GGUF tokenizer and chat template, and the model cache.

pub mod bert;
pub mod fetch;
pub mod llama;
pub mod tokenizer;
