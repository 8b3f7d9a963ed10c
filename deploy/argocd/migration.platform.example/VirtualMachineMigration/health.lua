-- Argo CD health check for migration.platform.example/VirtualMachineMigration.
--
-- Healthy only when the migration Completed; Degraded when it Failed or waits
-- for a human (ManualInterventionRequired); Progressing otherwise, including
-- before the controller wrote any status. A migration that is retrying is
-- Progressing, not Degraded: it recovers on its own or ends in one of the two.
--
-- The same text is embedded in ../../argocd-cm-patch.yaml; tests/argocd_health.rs
-- checks that the two are identical and runs health_test.yaml against this file.
-- Argo CD runs gopher-lua (Lua 5.1): no goto, no integer division, no utf8.
local hs = {}

-- The checkpoints of the happy path. An error recorded in any other phase is
-- finishing work of a terminal phase (a cleanup being retried), not the cause
-- of the failure; the controller's Stalled condition skips those the same way.
local active = {
  Pending = true, Discovering = true, Validated = true, Preparing = true, Converting = true,
  Importing = true, CreatingVM = true, Starting = true, Validating = true,
}

local function text(value)
  if value == nil then
    return ""
  end
  return tostring(value)
end

-- Whole numbers print without a fraction in every Lua (5.4 prints 42.0 for a float).
local function whole(value)
  if type(value) ~= "number" then
    return text(value)
  end
  return string.format("%d", math.floor(value))
end

local function condition(status, wanted)
  if type(status.conditions) ~= "table" then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == wanted then
      return c
    end
  end
  return nil
end

-- "Reason: message" of the newest error of a working phase, else the message
-- of a True Stalled condition, else nil.
local function cause(status)
  if type(status.errors) == "table" then
    for i = #status.errors, 1, -1 do
      local e = status.errors[i]
      if active[e.phase] then
        return text(e.reason) .. ": " .. text(e.message)
      end
    end
  end
  local stalled = condition(status, "Stalled")
  if stalled ~= nil and stalled.status == "True" and text(stalled.message) ~= "" then
    return text(stalled.message)
  end
  return nil
end

-- " of <retryLimit>" when the spec says (the API server defaults it to 5).
local function of_limit(spec)
  if spec ~= nil and spec.strategy ~= nil and spec.strategy.retryLimit ~= nil then
    return " of " .. whole(spec.strategy.retryLimit)
  end
  return ""
end

local status = obj.status
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the vmmigrate controller to report status"
  return hs
end

local phase = text(status.phase)

if phase == "Completed" then
  hs.status = "Healthy"
  local vm = status.destinationVM
  if vm ~= nil and vm.name ~= nil then
    hs.message = "Completed: VirtualMachine " .. text(vm.namespace) .. "/" .. text(vm.name) .. " migrated"
  else
    hs.message = "Completed"
  end
  return hs
end

if phase == "Failed" or phase == "ManualInterventionRequired" then
  hs.status = "Degraded"
  local why = cause(status)
  if why ~= nil then
    hs.message = phase .. ": " .. why
  else
    hs.message = phase
  end
  return hs
end

hs.status = "Progressing"
if phase == "Retryable" then
  local retry = status.retry
  if retry ~= nil then
    hs.message = "Retryable: attempt " .. whole(retry.attempt) .. of_limit(obj.spec) .. " for " .. text(retry.phase)
    if retry.nextAttemptAt ~= nil then
      hs.message = hs.message .. " at " .. text(retry.nextAttemptAt)
    end
  else
    hs.message = "Retryable"
  end
  local why = cause(status)
  if why ~= nil then
    hs.message = hs.message .. " after " .. why
  end
  return hs
end

hs.message = phase
if status.progress ~= nil and status.progress.percent ~= nil then
  hs.message = hs.message .. ": " .. whole(status.progress.percent) .. "%"
end
if status.retry ~= nil and status.retry.attempt ~= nil then
  hs.message = hs.message .. " (retry attempt " .. whole(status.retry.attempt) .. of_limit(obj.spec) .. ")"
end
return hs
