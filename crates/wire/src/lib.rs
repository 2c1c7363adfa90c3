//! vLLM/SGLang KV-event wire codec (in progress).
