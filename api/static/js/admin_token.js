// The admin token lives only in this tab (sessionStorage): never in a cookie, never sent
// anywhere but the X-Admin-Token header of admin calls to this same peer.

const KEY = "inclavate.adminToken";

export function adminToken() {
  try {
    return sessionStorage.getItem(KEY) || "";
  } catch (_) {
    return "";
  }
}

export function setAdminToken(token) {
  if (token) sessionStorage.setItem(KEY, token);
  else sessionStorage.removeItem(KEY);
}

/** Headers for an admin call; empty when no token was entered (the peer then answers 403). */
export function adminHeaders() {
  const token = adminToken();
  return token ? { "X-Admin-Token": token } : {};
}
