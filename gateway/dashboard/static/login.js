// The login form: carry ?next= into the form, and say when the last try failed.
const query = new URLSearchParams(location.search);
const next = query.get("next");
// The daemon checks it again: only its own pages, printable ASCII, no "//".
if (next && /^\/(inspect\/[\x21-\x7e]*)?(\?[\x21-\x7e]*)?$/.test(next) && !next.includes("//") && !next.includes("\\")) {
  document.getElementById("next").value = next;
}
if (query.get("failed")) {
  document.getElementById("failed").hidden = false;
}
