// Screenshot a Phoenix trace page (span tree with durations, the kv.transfer span's attributes):
//   node trace_screenshot.cjs URL OUT.png
// Needs playwright-core (npm, found through NODE_PATH) and Debian's /usr/bin/chromium;
// scripts/trace_screenshot.py runs it.
const { chromium } = require("playwright-core");

async function main(url, out) {
  const browser = await chromium.launch({
    executablePath: "/usr/bin/chromium",
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
           "--disable-component-update", "--disable-sync"],
  });
  try {
    const page = await browser.newPage({ viewport: { width: 1600, height: 1000 } });
    await page.goto(url, { waitUntil: "networkidle", timeout: 60000 });
    await page.getByText("kv.transfer").first().waitFor({ timeout: 60000 });
    // Select the KV transfer span so its attributes (bytes, blocks, outcome, attempt) show beside the tree.
    await page.getByText("kv.transfer").first().click();
    await page.getByRole("tab", { name: "Attributes" }).first().click();
    await page.waitForTimeout(1500);
    await page.screenshot({ path: out });
  } finally {
    await browser.close();
  }
}

main(process.argv[2], process.argv[3]).catch((err) => { console.error(err); process.exit(1); });
