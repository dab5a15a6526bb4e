// The runtime's notices in the page: a model the automatic mode left on the host, a model it refused. The server sends
// each as the event "tpu_video.notice" ({text, level, node}: nodes/comfy_bridge.py's send_notice); it is shown as a
// toast where the frontend has them, and always in the browser's console and above the node it came from.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

export const NOTICE_EVENT = "tpu_video.notice";
const SEVERITY = { warning: "warn", error: "error", info: "info" };

function nodeOf(id) {
  if (id === null || id === undefined) return null;
  const graph = app.graph;
  return graph?.getNodeById?.(Number(id)) ?? graph?.getNodeById?.(id) ?? null;
}

// A line of text drawn above the node's title until the next prompt: the node's status where no toast shows it.
function markNode(node, text) {
  if (!node) return;
  node.tpuVideoNotice = text;
  if (!node.tpuVideoNoticeDrawn) {
    const draw = node.onDrawForeground;
    node.onDrawForeground = function (ctx, ...rest) {
      const result = draw?.call(this, ctx, ...rest);
      if (this.tpuVideoNotice && ctx?.fillText) {
        const titleHeight = globalThis.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
        ctx.save();
        ctx.fillStyle = "#e0a030";
        ctx.font = "12px sans-serif";
        ctx.fillText(`TPU video: ${this.tpuVideoNotice}`.slice(0, 160), 0, -titleHeight - 6);
        ctx.restore();
      }
      return result;
    };
    node.tpuVideoNoticeDrawn = true;
  }
  node.setDirtyCanvas?.(true, true);
}

export function showNotice(detail) {
  const text = String(detail?.text ?? "");
  if (!text) return;
  const level = detail?.level ?? "warning";
  console.warn(`TPU video: ${text}`);
  markNode(nodeOf(detail?.node), text);
  const toast = app.extensionManager?.toast;
  if (toast?.add) {
    toast.add({ severity: SEVERITY[level] ?? "warn", summary: "TPU video", detail: text, life: 20000 });
  }
}

app.registerExtension({
  name: "TPUVideo.Notices",
  setup() {
    api.addEventListener(NOTICE_EVENT, (event) => showNotice(event.detail));
    // A new prompt starts clean: the notices drawn on nodes belong to the last one.
    api.addEventListener("execution_start", () => {
      for (const node of app.graph?._nodes ?? app.graph?.nodes ?? []) {
        if (node.tpuVideoNotice) {
          node.tpuVideoNotice = null;
          node.setDirtyCanvas?.(true, true);
        }
      }
    });
  },
});
