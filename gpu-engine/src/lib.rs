//! lockstep-engine: the embedded paged-attention engine (page pool with ownership tags, verified
//! KV transfer, CPU and CUDA attention). Not built yet: this crate only reserves its place in the
//! workspace; see the engine issues.
