//! Writes a GGUF model's tokenizer (`tokenizer.json`) and chat template (`chat_template.jinja`)
//! into a folder, for routers in front of remote workers of that model (`models[].tokenizer`,
//! `models[].chat_template = { path = ... }`); `bench/long_prompts.sh` uses it.
//!
//!     cargo run --release -p lockstep-engine --example export_tokenizer -- MODEL.gguf OUT_DIR

use lockstep_engine::tokenizer::ModelTokenizer;

fn main() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let (Some(model), Some(out)) = (args.next(), args.next()) else {
        return Err("usage: export_tokenizer MODEL.gguf OUT_DIR".into());
    };
    let g = lockstep_engine::gguf::open(std::path::Path::new(&model)).map_err(|e| e.to_string())?;
    let t = ModelTokenizer::from_gguf(&g).map_err(|e| e.to_string())?;
    let out = std::path::Path::new(&out);
    std::fs::create_dir_all(out).map_err(|e| e.to_string())?;
    t.inner
        .save(out.join("tokenizer.json"), false)
        .map_err(|e| e.to_string())?;
    let template = t
        .chat_template
        .ok_or("the model file has no chat template")?;
    std::fs::write(out.join("chat_template.jinja"), template).map_err(|e| e.to_string())?;
    Ok(())
}
