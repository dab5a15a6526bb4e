// The automatic mode's entry in ComfyUI's settings dialog. The server reads the value from ComfyUI's settings store at
// each prompt (tpu_runtime/bridge/auto.py): "as started" keeps what TPU_VIDEO_AUTO said when the server started.
import { app } from "../../scripts/app.js";

app.registerExtension({
  name: "TPUVideo.AutomaticMode",
  settings: [
    {
      id: "TPUVideo.AutomaticMode",
      category: ["TPU video", "Automatic mode", "Parts"],
      name: "Run every loaded model on the TPU (no TPU nodes needed)",
      type: "combo",
      options: ["as started", "all", "off", "model", "model,text", "model,vae", "model,text,vae"],
      defaultValue: "as started",
      tooltip:
        "all: every diffusion model, text encoder, VAE, CLIP vision model and audio encoder that a loader loads runs " +
        "on the TPU, as if TPU Diffusion Model, TPU Text Encoder, TPU VAE, TPU CLIP Vision and TPU Audio Encoder " +
        "stood after each loader. " +
        "model / text / vae: only those parts. as started: what the server's TPU_VIDEO_AUTO says. " +
        "Takes effect at the next prompt.",
    },
  ],
});
