// The official TypeScript MCP client (@modelcontextprotocol/sdk's Client and StdioClientTransport, the
// client the MCP Inspector CLI is built on) driving a stdio MCP server: tests/test_mcp_gate_ts.py.
//
//   node client.mjs PLAN.json
//
// PLAN: {"command": ..., "args": [...], "env": {...}, "calls": [{"name": ..., "arguments": {...}}, ...]}.
// It connects (initialize), lists the tools (so the client knows every outputSchema and validates
// structuredContent against it, as the SDK does), makes the calls one after another and prints one JSON
// line per step on stdout: {"step": "initialize"|"list"|"call", ...}. A call the client itself rejects
// (an McpError, e.g. "Structured content does not match the tool's output schema") is printed as
// {"step": "call", "name", "thrown": MESSAGE}: the test fails on it. Exit 0 when every step ran.
import { readFileSync } from "node:fs";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";

const plan = JSON.parse(readFileSync(process.argv[2], "utf8"));
const say = (o) => process.stdout.write(JSON.stringify(o) + "\n");
const transport = new StdioClientTransport({
  command: plan.command, args: plan.args, env: plan.env, stderr: "inherit",
});
const client = new Client({ name: "pgw-ts-client-test", version: "0.1.0" });
const started = Date.now();
await client.connect(transport);
say({ step: "initialize", ms: Date.now() - started, server: client.getServerVersion() });
const listed = await client.listTools();
say({ step: "list", tools: listed.tools.map((t) => ({ name: t.name, outputSchema: t.outputSchema ?? null })) });
for (const call of plan.calls ?? []) {
  try {
    const result = await client.callTool({ name: call.name, arguments: call.arguments ?? {} }, undefined,
      { timeout: 120000, resetTimeoutOnProgress: true, onprogress: () => {} });
    say({ step: "call", name: call.name, result });
  } catch (e) {
    say({ step: "call", name: call.name, thrown: String(e && e.message ? e.message : e) });
  }
}
await client.close();
