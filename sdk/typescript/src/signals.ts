/** An AbortController of the SDK's own that also follows the caller's signal. */
export function linkedController(parent: AbortSignal | undefined): { controller: AbortController; unlink: () => void } {
  const controller = new AbortController();
  if (!parent) return { controller, unlink: () => undefined };
  if (parent.aborted) {
    controller.abort(parent.reason);
    return { controller, unlink: () => undefined };
  }
  const follow = () => controller.abort(parent.reason);
  parent.addEventListener('abort', follow, { once: true });
  return { controller, unlink: () => parent.removeEventListener('abort', follow) };
}
