//! `strata-tools perplexity`: perplexity of a model over a text file, computed the way llama.cpp's
//! `llama-perplexity` does: the tokens are cut into chunks of `--ctx`, each chunk runs from an empty KV cache,
//! and the second half of each chunk is scored (the first half is context).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use strata::gguf::GgufFile;
use strata::model::perplexity::perplexity;
use strata::model::{Model, Tokenizer};

/// `perplexity` arguments.
#[derive(Debug, Args)]
pub struct PerplexityArgs {
    /// GGUF model file.
    #[arg(long)]
    model: PathBuf,
    /// UTF-8 text to score.
    #[arg(long)]
    file: PathBuf,
    /// Tokens per chunk (the second half of each is scored).
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Score at most this many chunks (0 = all).
    #[arg(long, default_value_t = 0)]
    chunks: usize,
    /// Override the model's experts per token (top-k), in 1..=expert_count.
    #[arg(long)]
    experts_used: Option<usize>,
    /// CPU worker threads [default: physical cores].
    #[arg(long)]
    threads: Option<usize>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Runs the measurement and prints the result to stdout.
pub fn run(a: PerplexityArgs) -> Result<()> {
    if a.ctx < 4 {
        bail!("--ctx must be at least 4");
    }
    let file = Arc::new(GgufFile::open(&a.model).with_context(|| format!("loading model {}", a.model.display()))?);
    let mut m = Model::load(file.clone()).with_context(|| format!("loading model {}", a.model.display()))?;
    m.set_threads(a.threads.unwrap_or_else(num_cpus::get_physical))?;
    if let Some(k) = a.experts_used {
        if m.cfg.n_expert == 0 || k == 0 || k > m.cfg.n_expert {
            bail!("--experts-used {k}: the model has {} experts per layer", m.cfg.n_expert);
        }
        m.cfg.n_expert_used = k;
    }
    let tok = Tokenizer::from_gguf(&file)?;
    let text = std::fs::read_to_string(&a.file).with_context(|| format!("--file {}", a.file.display()))?;
    let ids = tok.encode(&text, false, false)?;
    let t0 = std::time::Instant::now();
    let Some(r) = perplexity(&m, &ids, a.ctx, a.chunks) else {
        bail!("the text has {} tokens, fewer than one chunk of {}", ids.len(), a.ctx);
    };
    if a.json {
        let o = serde_json::json!({"model": a.model, "tokens": ids.len(), "chunks": r.chunks, "ctx": a.ctx,
            "scored": r.scored, "experts_used": m.cfg.n_expert_used, "ppl": r.ppl, "seconds": t0.elapsed().as_secs_f64()});
        println!("{o}");
    } else {
        println!(
            "{}: {} chunks of {} tokens, {} scored, perplexity {:.4} ({:.1} s)",
            a.model.display(),
            r.chunks,
            a.ctx,
            r.scored,
            r.ppl,
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
