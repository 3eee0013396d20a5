// The login form: carry ?next= into the form, and say when the last try failed.
const query = new URLSearchParams(location.search);
const next = query.get("next");
if (next && next.startsWith("/") && !next.startsWith("//")) {
  document.getElementById("next").value = next;
}
if (query.get("failed")) {
  document.getElementById("failed").hidden = false;
}
