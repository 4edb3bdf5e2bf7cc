// Same-origin JSON calls to the peer that served the page. Every failure becomes an
// ApiError with the status and the server's own message (either of the spec's two error
// shapes), so a page can always show a sentence instead of going blank.

export class ApiError extends Error {
  constructor(status, message, path) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.path = path;
  }

  /** The route is not served by this peer at all (an optional feature it lacks). */
  get notServed() {
    return this.status === 404 || this.status === 405;
  }

  describe() {
    if (this.status === 0) return this.message;
    return `${this.message} (HTTP ${this.status} from ${this.path})`;
  }
}

export async function errorMessage(response) {
  try {
    const body = await response.json();
    const error = body && body.error;
    if (typeof error === "string") return error;
    if (error && typeof error.message === "string") return error.message;
  } catch (_) {
    // not JSON: fall through to the status text
  }
  return response.statusText || `HTTP ${response.status}`;
}

/**
 * One request. body: an object (sent as JSON), a Blob or FormData (sent as is).
 * Returns the decoded JSON (or text), null for 204, or the Response itself with raw: true.
 */
export async function request(method, path, { body, headers = {}, signal, raw = false } = {}) {
  const init = { method, headers: { ...headers }, signal, credentials: "same-origin", cache: "no-store" };
  if (body !== undefined) {
    if (body instanceof Blob || body instanceof FormData) {
      init.body = body;
    } else {
      init.body = JSON.stringify(body);
      init.headers["Content-Type"] = "application/json";
    }
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, `this peer did not answer ${method} ${path} (${err.message}); is it still running?`, path);
  }
  if (!response.ok) throw new ApiError(response.status, await errorMessage(response), path);
  if (raw) return response;
  if (response.status === 204) return null;
  const type = response.headers.get("content-type") || "";
  return type.includes("json") ? response.json() : response.text();
}

export const get = (path, options) => request("GET", path, options);

export function isAbort(err) {
  return err && err.name === "AbortError";
}
