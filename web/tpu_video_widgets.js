// The pack's inputs in the page: the compilation cache folder as a setting of the server (one per process, so not an
// input of each node; the server reads it when the runtime starts: tpu_runtime/bridge/settings_store.py), and
// workflows saved with older inputs brought up to date before the page builds them (nodes/migration.py): the page
// puts saved widget values back by position, so a removed input would move every value after it.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const MARK = "tpu_video_inputs"; // nodes/migration.py: MARK, VERSION
const VERSION = 2;
const ROUTE = "/tpu_video/migrate_workflow";
const PACK_NODE = /^TPU[A-Z]/;

function allNodes(graph) {
  const subgraphs = graph?.definitions?.subgraphs ?? [];
  return [...(graph?.nodes ?? []), ...subgraphs.flatMap((subgraph) => subgraph.nodes ?? [])];
}

function toast(severity, summary, detail) {
  const toasts = app.extensionManager?.toast;
  if (toasts) toasts.add({ severity, summary, detail, life: 12000 });
  else console.warn(`${summary}: ${detail}`);
}

app.registerExtension({
  name: "TPUVideo.Inputs",
  settings: [
    {
      id: "TPUVideo.CacheDir",
      category: ["TPU video", "Compilation", "Cache folder"],
      name: "Compilation cache folder (compiled programs kept for the next start)",
      type: "text",
      defaultValue: "",
      tooltip:
        "Where compiled TPU programs are kept, so a restarted ComfyUI compiles nothing it has seen. Empty: " +
        "$TPU_VIDEO_CACHE_DIR, else ~/.cache/tpu_video_nodes/xla_cache. One folder per server process: a " +
        "change takes effect at the next start of ComfyUI.",
    },
  ],

  async beforeConfigureGraph(graph) {
    const older = allNodes(graph).filter(
      (node) => PACK_NODE.test(node.type ?? "") && (node.properties?.[MARK] ?? 0) < VERSION,
    );
    if (!older.length) return;
    try {
      const response = await api.fetchApi(ROUTE, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(graph),
      });
      if (!response.ok) throw new Error(`${response.status} ${await response.text()}`);
      const { workflow, notes } = await response.json();
      // The page goes on with this very object: change it in place.
      for (const key of Object.keys(graph)) delete graph[key];
      Object.assign(graph, workflow);
      if (notes.length) {
        toast("info", "TPU video: workflow saved with older inputs, updated", notes.join("\n"));
      }
    } catch (error) {
      console.error("TPU video: could not update the workflow's older inputs", error);
      toast(
        "warn",
        "TPU video: workflow saved with older inputs",
        "Its TPU nodes could not be updated (" + error + "): check their values (cache_dir is now a setting; " +
          "frames is length, guidance is cfg; shift, cfg_2 and boundary are inputs left unconnected).",
      );
    }
  },

  nodeCreated(node) {
    // A node made by this page has today's inputs; saved with it, the mark tells a later page not to migrate it.
    if (PACK_NODE.test(node.comfyClass ?? node.type ?? "")) {
      node.properties ??= {};
      node.properties[MARK] = VERSION;
    }
  },
});
